"""The README's usage example and the quickstart run as written (on the host backend here)."""
import re
import runpy
import sys
from pathlib import Path

from oracle import check_stats

ROOT = Path(__file__).resolve().parent.parent


def test_readme_usage_runs():
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    namespace = {}
    exec(compile(code.replace('backend="auto"', 'backend="host"'), "README.md", "exec"), namespace)
    assert namespace["mgr"].stats()["requests"] == 1
    check_stats(namespace["mgr"])


def test_quickstart_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--backend", "host", "--steps", "120"])
    try:
        runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    except SystemExit as e:
        assert e.code == 0
    assert "quickstart OK on the host backend" in capsys.readouterr().out

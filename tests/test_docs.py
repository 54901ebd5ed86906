"""The README's usage example and the quickstart run as written (on the host backend here)."""
import re
import runpy
import sys
from pathlib import Path

from oracle import check_stats

ROOT = Path(__file__).resolve().parent.parent


def test_readme_usage_runs():
    code = next(c for c in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                if "KVCacheManager" in c)
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


def test_readme_transformers_example_runs():
    import pytest
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    code = next(c for c in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
                if "cupykv.hf" in c)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(namespace["answer"]) == len(namespace["follow_up"]) == 8
    assert namespace["engine"].stats.hit_tokens >= 48


def test_api_reference_is_current():
    """docs/api.md is what scripts/api_doc.py writes from the docstrings."""
    import subprocess
    import pytest
    pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed: cupykv.hf's part")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "api_doc.py"), "--check"], capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stdout + run.stderr

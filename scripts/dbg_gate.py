import faulthandler, sys, time
sys.path.insert(0, "tests")
faulthandler.dump_traceback_later(4, exit=False)
from test_races import *
t0 = time.time()
mgr = make("cuda", "snapshot")
warm(mgr, ["a", "b"], prompt=150)
cap = Capture(mgr)
gate = mgr.backend.gate(mgr.backend.stream)
step = mgr.prepare_batch((), ["a", "b"], num_gen_tokens=3); cap.consume(step)
print("n", time.time()-t0, flush=True)
mgr.settle(step, {"a": 1, "b": 3}); mgr.free("a"); mgr.add("new", 200)
s = mgr.prepare_batch({"new": 200}, ["b"]); cap.consume(s); mgr.settle(s)
print("n+1", time.time()-t0, flush=True)
for i in range(40):
    s = mgr.prepare_batch((), ["new", "b"]); cap.consume(s); mgr.settle(s)
    print(i, time.time()-t0, len(mgr.ring.slots), flush=True)
gate.open(); mgr.synchronize(); print("timeout", gate.close_timeout_hit(), cap.mismatches())

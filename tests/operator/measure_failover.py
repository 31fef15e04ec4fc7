"""Measure leader-election failover with the default timings (15 s lease, 5 s renew, 2 s
retry) against KMock: `python tests/operator/measure_failover.py` (about 20 s). Figures are
in docs/operator.md ("Several replicas, one active"); the test of the same replicas with a 6 s
lease is tests/operator/test_operator_leader.py."""
import asyncio, sys, time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
import kmock
from operator_testkit import StampingEmulator, RESOURCES, VERBS, wait_for
import test_operator_leader as T

async def main():
    async with StampingEmulator() as emulator, kmock.Server(emulator):
        for resource, info in RESOURCES.items():
            info.verbs = set(VERBS); emulator.resources[resource] = info
        server = str(emulator.url).rstrip("/")
        for trial in range(2):
            log = []
            a, b = T.Replica(server, f"a{trial}", log), T.Replica(server, f"b{trial}", log)
            for r in (a, b):
                r.elector.lease_duration, r.elector.renew_period, r.elector.retry_period = 15.0, 5.0, 2.0
            a.start(); await wait_for(lambda: T.active(log) == {a.name}, timeout=30)
            b.start(); await asyncio.sleep(1)
            t0 = time.monotonic()
            if trial == 0:
                a.crash_network()
            else:
                a.task.cancel()
            await wait_for(lambda: T.active(log) == {b.name}, timeout=60)
            took = next(t for t, n, w in log if n == b.name and w == "start")
            stop = next(t for t, n, w in log if n == a.name and w == "stop")
            print(("leader lost API" if trial == 0 else "clean shutdown"), f"failover {took - t0:.1f}s; old leader stopped {stop - t0:.1f}s after")
            b.task.cancel()
            for r in (a, b):
                await asyncio.gather(r.task, return_exceptions=True); await r.api.close()
asyncio.run(main())

#!/usr/bin/env python3
"""node-probe: step behaviours the real-node tests (e2e/tests/node.rs) need, written with the
agentrun_step SDK like any step.

    probe.py context              result: the names and results of the context's steps
    probe.py logs --lines N       prints N numbered lines to stdout, then succeeds
    probe.py oom --mib N          allocates N MiB and touches them (past the memory limit:
                                  the kernel OOM-kills the container)
    probe.py fail-partial         writes a partial message (tokens and an error), exits 3
    probe.py sleep --seconds S    sleeps, then succeeds with {"slept": S}
"""

import argparse
import sys
import time

from agentrun_step import Step


def main():
    p = argparse.ArgumentParser(prog="node-probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("context")
    s = sub.add_parser("logs"); s.add_argument("--lines", type=int, default=3)
    s = sub.add_parser("oom"); s.add_argument("--mib", type=int, default=512)
    sub.add_parser("fail-partial")
    s = sub.add_parser("sleep"); s.add_argument("--seconds", type=float, default=1.0)
    a = p.parse_args()
    step = Step.load()

    if a.cmd == "context":
        step.succeed({"results": step.results,
                      "idempotencyKey": step.idempotency_key, "attempt": step.attempt})
    elif a.cmd == "logs":
        for i in range(1, a.lines + 1):
            print(f"probe log line {i} of {a.lines} (step {step.step})", flush=True)
        step.succeed({"lines": a.lines})
    elif a.cmd == "oom":
        chunks = []
        for _ in range(a.mib):
            chunks.append(bytearray(b"\x01" * (1 << 20)))
        step.succeed({"allocatedMiB": a.mib})  # only reached without a limit
    elif a.cmd == "fail-partial":
        step.fail("upstream tool returned 503 after 2 of 5 pages", result={"pagesDone": 2},
                  tokens={"input": 12, "output": 3}, exit_code=3)
    elif a.cmd == "sleep":
        time.sleep(a.seconds)
        step.succeed({"slept": a.seconds})
    return 0


if __name__ == "__main__":
    sys.exit(main())

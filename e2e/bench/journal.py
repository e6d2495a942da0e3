#!/usr/bin/env python3
"""What the step journal costs (docs/journal.md, D19) on the real plane: the Python SDK's
``Journal``, the code a step runs, writing as a step Pod with a token bound to its Pod under
the chart's journals policy, against a plain status write of the same run.

    make bench-journal                      # its own plane in target/e2e-journal, taken down
    e2e/bench/journal.py [--calls 200] [--rounds 5] [--batch 40] [--replays 5]

::

    this script ──kubectl──▶ CRDs, chart policies + roles, namespace, AgentRun (no operator),
                             Pending Pods <run>-<step>-<tag>-r1-a<n>, RoleBinding, bound tokens
        Journal(attempt 1, Pod a1's token) ──PUT/POST──▶ StepJournal <run>-<step>-<tag>-r1-journal-<k>
        admin (client certificate)       ──PATCH───▶ agentruns/bench/status (merge patch)
        Journal(attempt 2, Pod a2's token) ──GET──▶ every chunk, 200 calls replayed

It prints, in one run: append latency per write and per call (model calls with 1–2 KiB
answers, NonIdempotent tool calls: intent + answer) alternating one for one with status
writes of the answer's size; kube-apiserver CPU per write of interleaved batches (medians of
the rounds); the replay of a 200-call journal (PASS at ≤ 1 s); the request bytes of 100-, 200-
and 400-call loops; and the load average at start and end. It measures, it asserts nothing
but the replay's 1 s. Both clients open a TLS connection per request, as the SDK does.

It runs on the plane of $AGENTRUN_E2E_DIR (default target/e2e) with no operator, in a
namespace of its own; nothing else should use the plane meanwhile. Standard library only.
"""

import argparse
import hashlib
import json
import os
import random
import re
import secrets
import ssl
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "sdk", "python"))

from agentrun_step import journal as sdk  # noqa: E402

PLANE = os.environ.get("AGENTRUN_E2E_DIR", os.path.join(ROOT, "target", "e2e"))
CACHE = os.environ.get("AGENTRUN_CACHE", os.path.expanduser("~/.cache/agentrun-operator"))
TOOLS = os.path.join(CACHE, "tools")
CHART = "charts/agentrun-operator"
RUN = "bench"
#: The plane's admin (e2e/cluster's client certificate).
ADMIN = "agentrun-e2e-admin"
API = "/apis/agentrun.dev/v1alpha1"


# ---------------------------------------------------------------------------- measuring

class Recorder:
    """The SDK's HTTP layer, counted: each request's method, body bytes sent and received,
    and its wall time up to the last byte of the answer (the SDK reads it whole)."""

    def __init__(self):
        self.writes = []  # (method, sent, received, seconds) of every request but GET
        self.reads = 0

    def urlopen(self, req, timeout=None, context=None):
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
                body, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            self._count(req, 0, start)  # the SDK reads the refusal's body itself
            raise
        self._count(req, len(body), start)
        return _Answer(status, body)

    def _count(self, req, received, start):
        if req.get_method() == "GET":
            self.reads += 1
        else:
            self.writes.append((req.get_method(), len(req.data or b""), received,
                                time.perf_counter() - start))

    def mark(self):
        return len(self.writes)

    def since(self, mark):
        return self.writes[mark:]


class _Answer:
    def __init__(self, status, body):
        self.status, self._body = status, body

    def read(self):
        return self._body

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


RECORDER = Recorder()
# The SDK reaches the network only through urllib.request.urlopen: give its module a
# urllib whose urlopen is counted, leaving every other user of urllib alone.
sdk.urllib = types.SimpleNamespace(
    request=types.SimpleNamespace(Request=urllib.request.Request, urlopen=RECORDER.urlopen),
    error=urllib.error, parse=sdk.urllib.parse)


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs, q):
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))]


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def ms(x):
    return f"{1000 * x:.1f}"


def loadavg():
    return " ".join(open("/proc/loadavg").read().split()[:3])


# ---------------------------------------------------------------------------- the plane

class Plane:
    def __init__(self):
        kc = open(os.path.join(PLANE, "kubeconfig")).read()
        field = lambda k: re.search(rf"{k}: (\S+)", kc).group(1)  # noqa: E731
        self.server, self.ca = field("server"), field("certificate-authority")
        self.admin = ssl.create_default_context(cafile=self.ca)
        self.admin.load_cert_chain(field("client-certificate"), field("client-key"))
        pid = lambda name: int(open(os.path.join(PLANE, "state", f"{name}.pid")).read())  # noqa: E731
        self.apiserver, self.etcd = pid("kube-apiserver"), pid("etcd")
        self.env = dict(os.environ, KUBECONFIG=os.path.join(PLANE, "kubeconfig"),
                        PATH=TOOLS + os.pathsep + os.environ.get("PATH", ""))

    def run(self, *args, stdin=None):
        out = subprocess.run(args, input=stdin, capture_output=True, text=True, env=self.env,
                             cwd=ROOT)
        if out.returncode:
            sys.exit(f"{' '.join(args)}: {out.stderr.strip()}")
        return out.stdout

    def kubectl(self, *args, stdin=None):
        return self.run("kubectl", *args, stdin=stdin)

    def cpu(self):
        return cpu_seconds(self.apiserver), cpu_seconds(self.etcd)

    def admin_call(self, method, path, body, content_type):
        """One admin request as the SDK makes its own: a new TLS connection, the body whole."""
        req = urllib.request.Request(self.server + path, data=json.dumps(body).encode(),
                                     method=method, headers={"Content-Type": content_type,
                                                             "Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=30, context=self.admin) as resp:
            resp.read()


def setup(plane, ns, steps):
    """CRDs, the chart's policies and roles for `ns` only, the run, a Pending Pod per (step,
    attempt), the journal-writer binding and a token bound to each Pod."""
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", "crds/agentrun.dev_crds.yaml")
    plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                  "crd/agentruns.agentrun.dev", "crd/stepjournals.agentrun.dev")
    release = f"agentrun-operator-{ns.rsplit('-', 1)[1]}"
    selector = json.dumps({"matchLabels": {"kubernetes.io/metadata.name": ns}})
    rendered = plane.run("helm", "template", release, CHART, "--namespace", ns,
                         "--show-only", "templates/admission-policies.yaml",
                         "--show-only", "templates/roles.yaml",
                         "--set", f"roles.prefix={release}",
                         "--set-json", f"admissionPolicies.namespaceSelector={selector}")
    plane.kubectl("apply", "--server-side", "-f", "-", stdin=rendered)
    plane.kubectl("create", "namespace", ns)
    # The creator stamped as the runs policy wants it (the mutating policy may not be
    # enforced yet).
    run = {"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
           "metadata": {"name": RUN, "annotations": {"agentrun.dev/requested-by": ADMIN}},
           "spec": {"steps": [{"name": s, "effect": "NonIdempotent", "journal": {},
                               "container": {"image": "registry.example/agent:1"}}
                              for s in steps]}}
    uid = json.loads(plane.kubectl("-n", ns, "create", "-o", "json", "-f", "-",
                                   stdin=json.dumps(run)))["metadata"]["uid"]
    plane.kubectl("-n", ns, "create", "rolebinding", "agentrun-journal-writer-default",
                  f"--clusterrole={release}-journal-writer", f"--serviceaccount={ns}:default")
    deadline = time.monotonic() + 60
    while subprocess.run(["kubectl", "-n", ns, "get", "serviceaccount", "default"],
                         capture_output=True, env=plane.env).returncode:
        if time.monotonic() > deadline:
            sys.exit(f"no default ServiceAccount in {ns} after 60 s")
        time.sleep(0.2)
    return uid, rendered


def cleanup(plane, ns, rendered):
    """The namespace and the policies rendered for it go (a reused plane stays clean)."""
    plane.kubectl("delete", "--ignore-not-found", "-f", "-", stdin=rendered)
    plane.kubectl("delete", "namespace", ns, "--wait=false")


def step_tag(run_uid, step):
    return hashlib.sha256(run_uid.encode() + b"\0" + step.encode()).hexdigest()[:6]


def step_pod(plane, ns, run_uid, step, attempt):
    """Step `step`'s attempt Pod (never scheduled: no node) and a token bound to it."""
    name = f"{RUN}-{step}-{step_tag(run_uid, step)}-r1-a{attempt}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"serviceAccountName": "default",
                    "containers": [{"name": "step", "image": "registry.example/agent:1"}]}}
    uid = json.loads(plane.kubectl("-n", ns, "create", "-o", "json", "-f", "-",
                                   stdin=json.dumps(pod)))["metadata"]["uid"]
    token = plane.kubectl("-n", ns, "create", "token", "default", "--bound-object-kind=Pod",
                          f"--bound-object-name={name}", f"--bound-object-uid={uid}",
                          "--duration=2h").strip()
    return token


class Step:
    """One journaled step of the run: its Pods' tokens and its journal per attempt."""

    def __init__(self, plane, ns, run_uid, name):
        self.plane, self.ns, self.run_uid, self.name = plane, ns, run_uid, name
        self.key = secrets.token_hex(16)
        self.tokens = {}

    def journal(self, attempt):
        if attempt not in self.tokens:
            self.tokens[attempt] = step_pod(self.plane, self.ns, self.run_uid, self.name, attempt)
        prefix = f"{RUN}-{self.name}-{step_tag(self.run_uid, self.name)}-r1-journal-"
        return sdk.Journal(self.plane.server, self.ns, prefix, RUN, self.run_uid, self.name, 1,
                           attempt, self.key, token=self.tokens[attempt], ca_file=self.plane.ca)


def wait_enforced(step):
    """Until the journals policy refuses this Pod a chunk of another step (dry run)."""
    j = step.journal(1)
    other = j._chunk(0, 0, [])
    other["metadata"]["name"] = other["metadata"]["name"].replace(f"-{step.name}-", "-other-")
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(
            j.api.base + j.api.path + "?dryRun=All", data=json.dumps(other).encode(),
            method="POST", headers={"Content-Type": "application/json",
                                    "Authorization": f"Bearer {step.tokens[1]}"})
        try:
            urllib.request.urlopen(req, context=j.api.ctx).read()
        except urllib.error.HTTPError as e:
            if e.code == 403 and b"own step" in e.read():
                return
        if time.monotonic() > deadline:
            sys.exit("the journals policy is not enforced after 30 s")
        time.sleep(0.5)


# ---------------------------------------------------------------------------- the calls

class Calls:
    """A model with 1–2 KiB answers and a NonIdempotent refund tool, the same every run."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.n = 0

    def text(self, size):
        return "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(size))

    def model_answer(self):
        size = self.rng.randint(1024, 2048)
        shell = {"id": f"chatcmpl-{self.rng.getrandbits(64):016x}", "object": "chat.completion",
                 "model": "gpt-4o-mini", "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": ""}}],
                 "usage": {"prompt_tokens": 812, "completion_tokens": 173}}
        shell["choices"][0]["message"]["content"] = self.text(size - len(json.dumps(shell)))
        return shell

    def model(self, j):
        self.n += 1
        request = {"model": "gpt-4o-mini", "messages": [{"role": "user",
                   "content": f"turn {self.n}: what next for order 4471?"}]}
        answer = self.model_answer()
        return j.model(request, lambda req: (answer, {"input": 812, "output": 173}))

    def tool(self, j):
        self.n += 1
        args = {"order": "4471", "amount": 1999, "turn": self.n}
        result = {"refundId": f"rf-{self.n}", "status": "issued", "note": self.text(240)}
        return j.tool(f"call_{self.n}", "issue_refund", args, "NonIdempotent", lambda key: result)

    def status_body(self, run_uid, step, size=None):
        """A status write carrying what one model call records: a 1–2 KiB answer (or an
        answer of `size` bytes)."""
        answer = self.text(size) if size else json.dumps(self.model_answer())
        return {"status": {"steps": [{
            "name": step, "planRevision": 1, "attempt": 1, "idempotencyKey": run_uid[:8] + "0" * 24,
            "pod": f"{RUN}-{step}-r1-a1", "phase": "Running",
            "result": {"answer": answer}}]}}


def never(*_):
    raise AssertionError("a replayed call was made again")


# ---------------------------------------------------------------------------- the measures

def latency(plane, ns, run_uid, steps, calls, n):
    """n model calls, then n tool calls, each followed by one status write (A/B)."""
    path = f"{API}/namespaces/{ns}/agentruns/{RUN}/status"
    out = {}
    for kind, step in (("model", steps["lat-model"]), ("tool", steps["lat-tool"])):
        j = step.journal(1)
        per_call, status = [], []
        mark = RECORDER.mark()
        for _ in range(n):
            t = time.perf_counter()
            getattr(calls, kind)(j)
            per_call.append(time.perf_counter() - t)
            body = calls.status_body(run_uid, step.name)
            t = time.perf_counter()
            plane.admin_call("PATCH", path, body, "application/merge-patch+json")
            status.append(time.perf_counter() - t)
        writes = RECORDER.since(mark)
        out[kind] = {"call": per_call, "write": [w[3] for w in writes], "status": status,
                     "sent": [w[1] for w in writes], "writes": len(writes)}
    return out


def cpu(plane, ns, run_uid, step, calls, rounds, batch, chunk_size):
    """Interleaved batches per round: model calls, status writes, tool calls, status writes,
    status writes as large as a model call's chunk PUT (`chunk_size`); kube-apiserver (and
    etcd) CPU per write of each batch."""
    path = f"{API}/namespaces/{ns}/agentruns/{RUN}/status"
    j = step.journal(1)
    j.load()
    calls.model(j)  # the takeover write, outside the batches
    per = {k: [] for k in ("model", "status-a", "tool", "status-b", "status-chunk")}
    per_call = {"model": [], "tool": []}
    etcd = {k: [] for k in per}
    for _ in range(rounds):
        for kind in per:
            mark = RECORDER.mark()
            api0, etcd0 = plane.cpu()
            if kind.startswith("status"):
                for _ in range(batch):
                    size = chunk_size if kind == "status-chunk" else None
                    plane.admin_call("PATCH", path, calls.status_body(run_uid, step.name, size),
                                     "application/merge-patch+json")
                writes, n_calls = batch, batch
            else:
                n_calls = batch if kind == "model" else batch // 2
                for _ in range(n_calls):
                    getattr(calls, kind)(j)
                writes = len(RECORDER.since(mark))
            api1, etcd1 = plane.cpu()
            per[kind].append((api1 - api0) / writes)
            etcd[kind].append((etcd1 - etcd0) / writes)
            if kind in per_call:
                per_call[kind].append((api1 - api0) / n_calls)
    return per, per_call, etcd


def loop(step, calls, n):
    """An agent loop of n calls, model and NonIdempotent tool in turn: request bytes sent."""
    j = step.journal(1)
    mark = RECORDER.mark()
    for i in range(n):
        (calls.model if i % 2 == 0 else calls.tool)(j)
    writes = RECORDER.since(mark)
    recorded = sum(sdk.entry_bytes(e) for e in j._entries)
    return {"sent": sum(w[1] for w in writes), "received": sum(w[2] for w in writes),
            "writes": len(writes), "recorded": recorded, "chunks": len(j._chunks)}


def replay(step, n, times):
    """A new attempt (2) reads every chunk and replays all n calls; nothing is called."""
    step.journal(2)  # its Pod and token, outside the timing
    walls = []
    for _ in range(times):
        calls = Calls(seed=n)  # the same questions the loop asked
        t = time.perf_counter()
        j = step.journal(2)
        j.load()
        for i in range(n):
            if i % 2 == 0:
                calls.n += 1
                j.model({"model": "gpt-4o-mini", "messages": [{"role": "user",
                         "content": f"turn {calls.n}: what next for order 4471?"}]}, never)
            else:
                calls.n += 1
                j.tool(f"call_{calls.n}", "issue_refund",
                       {"order": "4471", "amount": 1999, "turn": calls.n}, "NonIdempotent", never)
        walls.append(time.perf_counter() - t)
        if j.replayed != n or j.new != 0:
            sys.exit(f"replay: {j.replayed} replayed, {j.new} new, of {n}")
    return walls, len(j._chunks)


# ---------------------------------------------------------------------------- report

def report(args, lat, cpu_out, loops, walls, chunks, load0, load1, started):
    lines = []
    p = lines.append
    per, per_call, etcd = cpu_out
    p(f"## The step journal: {args.calls} calls per figure, plane {PLANE}")
    p("")
    p(f"load average (1, 5, 15 min): start {load0}, end {load1}; {time.time() - started:.0f} s")
    p("")
    p(f"### Latency, ms: {args.calls} model calls then {args.calls} NonIdempotent tool calls, "
      "each followed by one status merge patch (A/B, one for one)")
    p("")
    p("| what | n | p50 | p99 | request body, median bytes |")
    p("|---|---:|---:|---:|---:|")
    m, t = lat["model"], lat["tool"]
    status = m["status"] + t["status"]
    p(f"| journal write, model call (1–2 KiB answer; the chunk's PUT) | {m['writes']} | "
      f"{ms(median(m['write']))} | {ms(pct(m['write'], 99))} | {median(m['sent']):,.0f} |")
    p(f"| journal write, tool call (intent or answer) | {t['writes']} | {ms(median(t['write']))} | "
      f"{ms(pct(t['write'], 99))} | {median(t['sent']):,.0f} |")
    p(f"| model call, whole (its write(s), the model answering at once) | {len(m['call'])} | "
      f"{ms(median(m['call']))} | {ms(pct(m['call'], 99))} | |")
    p(f"| tool call, whole (intent + answer) | {len(t['call'])} | {ms(median(t['call']))} | "
      f"{ms(pct(t['call'], 99))} | |")
    p(f"| AgentRun status merge patch, admin (1–2 KiB answer) | {len(status)} | "
      f"{ms(median(status))} | {ms(pct(status, 99))} | |")
    p("")
    p(f"journal write p50 / status write p50: model ×{median(m['write']) / median(status):.2f}, "
      f"tool ×{median(t['write']) / median(status):.2f}")
    p("")
    p(f"### kube-apiserver CPU, ms: {args.rounds} rounds of interleaved batches ({args.batch} "
      f"model calls, {args.batch} status writes, {args.batch // 2} tool calls, {args.batch} "
      f"status writes, {args.batch} status writes of a chunk's size); medians of the rounds "
      "(min–max)")
    p("")
    p("| batch | per write | per call | etcd per write |")
    p("|---|---:|---:|---:|")
    rng = lambda xs: f"{ms(median(xs))} ({ms(min(xs))}–{ms(max(xs))})"  # noqa: E731
    for kind, label in (("model", "journal, model calls"), ("tool", "journal, tool calls"),
                        ("status-a", "status writes (after the model batch)"),
                        ("status-b", "status writes (after the tool batch)"),
                        ("status-chunk", f"status writes of {args.chunk_size:,} bytes "
                                         "(a model call's median chunk PUT)")):
        pc = rng(per_call[kind]) if kind in per_call else ""
        p(f"| {label} | {rng(per[kind])} | {pc} | {ms(median(etcd[kind]))} |")
    st = median(per["status-a"] + per["status-b"])
    p("")
    p(f"per write against a status write: model ×{median(per['model']) / st:.2f}, "
      f"tool ×{median(per['tool']) / st:.2f}; a status write of a chunk's size "
      f"×{median(per['status-chunk']) / st:.2f}")
    p("")
    p("### Replay and bytes: loops of model and NonIdempotent tool calls in turn")
    p("")
    ok = median(walls) <= 1.0
    p(f"replay of the {args.calls}-call journal ({chunks} chunks) by attempt 2, nothing called: "
      f"median {ms(median(walls))} ms of {len(walls)} (min {ms(min(walls))}, max "
      f"{ms(max(walls))}): {'PASS' if ok else 'FAIL'} against 1 s")
    p("")
    p("| calls | writes | request bytes sent | per call | recorded bytes (maxBytes count) | "
      "sent / recorded | chunks |")
    p("|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in loops.items():
        p(f"| {n} | {r['writes']} | {r['sent']:,} | {r['sent'] / n:,.0f} | {r['recorded']:,} | "
          f"{r['sent'] / r['recorded']:.1f} | {r['chunks']} |")
    ns_ = sorted(loops)
    ratios = ", ".join(f"{b}/{a} calls ×{loops[b]['sent'] / loops[a]['sent']:.2f}"
                       for a, b in zip(ns_, ns_[1:]))
    p("")
    p(f"bytes sent: {ratios} (O(n): ×2.00 for twice the calls)")
    return "\n".join(lines) + "\n", ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200, help="calls per latency figure and replay")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of CPU batches")
    ap.add_argument("--batch", type=int, default=40, help="writes per CPU batch")
    ap.add_argument("--replays", type=int, default=5, help="replays of the journal")
    ap.add_argument("--report", help="also write the tables to this file")
    args = ap.parse_args()
    started, load0 = time.time(), loadavg()
    print(f"load average at start: {load0}", flush=True)
    plane = Plane()
    ns = f"journal-bench-{secrets.token_hex(3)}"
    sizes = (args.calls // 2, args.calls, args.calls * 2)
    names = ["lat-model", "lat-tool", "cpu"] + [f"loop{n}" for n in sizes]
    run_uid, rendered = setup(plane, ns, names)
    try:
        steps = {s: Step(plane, ns, run_uid, s) for s in names}
        wait_enforced(steps["lat-model"])
        print(f"namespace {ns}, run {RUN} ({run_uid}), journals policy enforced", flush=True)
        calls = Calls(seed=1)
        lat = latency(plane, ns, run_uid, steps, calls, args.calls)
        print("latency measured", flush=True)
        args.chunk_size = int(median(lat["model"]["sent"]))
        cpu_out = cpu(plane, ns, run_uid, steps["cpu"], calls, args.rounds, args.batch,
                      args.chunk_size)
        print("CPU measured", flush=True)
        loops = {n: loop(steps[f"loop{n}"], Calls(seed=n), n) for n in sizes}
        walls, chunks = replay(steps[f"loop{args.calls}"], args.calls, args.replays)
        text, ok = report(args, lat, cpu_out, loops, walls, chunks, load0, loadavg(), started)
    finally:
        cleanup(plane, ns, rendered)
    print("\n" + text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

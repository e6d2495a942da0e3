"""A fake API server for StepJournals on 127.0.0.1: GET, POST and PUT of one namespace's
stepjournals, with the rules of the real one that the SDK meets — resourceVersion
conflicts (409), AlreadyExists (409), 404 — and of the chart's `-journals` policy and the
CRD's CEL rules: a token names its Pod (chunk prefix and attempt), a chunk is written only
by its own step's Pods as their own attempt, an older attempt than the chunk carries is
refused (403, the fence), a sealed chunk never changes and recorded calls are never
removed (422). It counts the bytes it received and keeps a log of the writes.
"""

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATH = "/apis/agentrun.dev/v1alpha1/namespaces/{ns}/stepjournals"


def status(code, reason, message):
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                  "reason": reason, "message": message}


class Pod:
    """What a Pod-bound token tells the API server: the Pod's chunk prefix and attempt."""

    def __init__(self, prefix, attempt):
        self.prefix, self.attempt = prefix, attempt


class FakeApiServer:
    def __init__(self, namespace="shop", fence_first=True):
        self.namespace = namespace
        self.path = PATH.format(ns=namespace)
        self.lock = threading.Lock()
        self.objects = {}
        self.rv = 100
        self.tokens = {}  # token -> Pod
        #: Check the policy's fence before the resourceVersion (403), or after it (409).
        self.fence_first = fence_first
        self.received = 0
        self.writes = []  # (method, name, attempt, entry count, code)
        self.before_write = None  # called (method, name, body) before a write is judged
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self):
                if self.path == server.path:
                    return ""
                if self.path.startswith(server.path + "/"):
                    return self.path[len(server.path) + 1:]
                return None

            def do_GET(self):
                name = self._route()
                if not name:
                    return self._send(*status(404, "NotFound", "the server could not find it"))
                with server.lock:
                    obj = copy.deepcopy(server.objects.get(name))
                if obj is None:
                    return self._send(*status(404, "NotFound",
                                              f'stepjournals.agentrun.dev "{name}" not found'))
                self._send(200, obj)

            def _write(self, method):
                name = self._route()
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                body = json.loads(raw)
                pod = server.tokens.get(self.headers.get("Authorization", "")[len("Bearer "):])
                with server.lock:
                    server.received += len(raw)
                if server.before_write:
                    server.before_write(method, name, body)
                with server.lock:
                    code, out = server.judge(method, name, body, pod)
                    spec = body.get("spec") or {}
                    server.writes.append((method, body["metadata"]["name"], spec.get("attempt"),
                                          len(spec.get("entries") or []), code))
                self._send(code, out)

            def do_POST(self):
                if self._route() != "":
                    return self._send(*status(405, "MethodNotAllowed", "POST to the collection"))
                self._write("POST")

            def do_PUT(self):
                if not self._route():
                    return self._send(*status(405, "MethodNotAllowed", "PUT to an object"))
                self._write("PUT")

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()

    def token_for(self, prefix, attempt):
        token = f"token-{prefix}a{attempt}"
        self.tokens[token] = Pod(prefix, attempt)
        return token

    # What the API server decides about one write, under the lock.
    def judge(self, method, name, body, pod):
        meta, spec = body.get("metadata") or {}, body.get("spec") or {}
        name = meta.get("name") if method == "POST" else name
        if meta.get("name") != name:
            return status(400, "BadRequest", "the name of the object does not match the URL")
        if pod is None:
            return status(403, "Forbidden", f"stepjournal {name}: system:anonymous writes no journal")
        if not name.startswith(pod.prefix):
            return status(403, "Forbidden", f"stepjournal {name}: system:serviceaccount:shop:agent "
                                            f"may write only chunks named {pod.prefix}<n>")
        if spec.get("attempt") != pod.attempt:
            return status(403, "Forbidden", f"stepjournal {name}: spec.attempt is "
                                            f"{spec.get('attempt')} but the writing Pod is "
                                            f"attempt {pod.attempt}")
        old = self.objects.get(name)
        if method == "POST":
            if old is not None:
                return status(409, "AlreadyExists", f'stepjournals.agentrun.dev "{name}" already exists')
            owners = meta.get("ownerReferences") or []
            if not any(o.get("kind") == "AgentRun" and o.get("uid") == spec.get("runUid")
                       and o.get("name") == spec.get("runName") for o in owners):
                return status(422, "Invalid", f"stepjournal {name}: a journal chunk is owned by its AgentRun")
            return self._store(name, body, None)
        if old is None:
            return status(404, "NotFound", f'stepjournals.agentrun.dev "{name}" not found')
        fence = old["spec"]["attempt"] > spec.get("attempt", 0)
        if fence and self.fence_first:
            return status(403, "Forbidden", f"stepjournal {name}: attempt {old['spec']['attempt']} "
                                            "has taken this journal over; an older attempt may not write it")
        if meta.get("resourceVersion") != old["metadata"]["resourceVersion"]:
            return status(409, "Conflict", f'Operation cannot be fulfilled on stepjournals.agentrun.dev "{name}": '
                                           "the object has been modified; please apply your changes to the latest version and try again")
        if fence:
            return status(422, "Invalid", f"spec.attempt: attempt {old['spec']['attempt']} has taken "
                                          "this journal over; an older attempt may not write it")
        if old["spec"].get("sealed") and spec != old["spec"]:
            return status(422, "Invalid", "spec: a sealed journal chunk is final")
        if len(spec.get("entries") or []) < len(old["spec"].get("entries") or []):
            return status(422, "Invalid", "spec.entries: a recorded call is never removed")
        for f in ("runName", "runUid", "step", "planRevision", "chunk", "firstSeq"):
            if spec.get(f) != old["spec"].get(f):
                return status(422, "Invalid", f"spec.{f} is immutable")
        return self._store(name, body, old)

    def _store(self, name, body, old):
        entries = body["spec"].get("entries") or []
        if len(entries) > 32:
            return status(422, "Invalid", "spec.entries: Too many: must have at most 32 items")
        if entries and entries[0].get("seq") != body["spec"].get("firstSeq"):
            return status(422, "Invalid", "spec.entries: the first entry's seq is spec.firstSeq")
        obj = copy.deepcopy(body)
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        obj["metadata"]["namespace"] = self.namespace
        if old is not None:
            obj["status"] = copy.deepcopy(old.get("status") or {})
        self.objects[name] = obj
        return (201 if old is None else 200), copy.deepcopy(obj)

    # What the operator does: settle a call (a status write bumps the resourceVersion).
    def settle(self, name, seq, outcome, response=None, by="verify", attempt=None):
        """Settles the intent at ``seq``, of the attempt that wrote it unless
        ``attempt`` names another, as the operator does."""
        with self.lock:
            obj = self.objects[name]
            if attempt is None:
                first = obj["spec"].get("firstSeq", 0)
                attempt = obj["spec"]["entries"][seq - first]["attempt"]
            s = {"seq": seq, "attempt": attempt, "outcome": outcome, "by": by,
                 "at": "2026-12-06T14:05:00Z"}
            if response is not None:
                s["response"] = response
            st = obj.setdefault("status", {})
            st["settlements"] = [x for x in st.get("settlements", [])
                                 if (x["seq"], x.get("attempt")) != (seq, attempt)] + [s]
            self.rv += 1
            obj["metadata"]["resourceVersion"] = str(self.rv)

    def entries(self):
        with self.lock:
            chunks = sorted(self.objects.values(), key=lambda o: o["spec"]["chunk"])
            return [e for c in chunks for e in c["spec"]["entries"]]

    def chunk(self, name):
        with self.lock:
            return copy.deepcopy(self.objects.get(name))

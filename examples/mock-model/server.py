#!/usr/bin/env python3
"""A scripted, OpenAI-compatible model server for tests and demos (standard library only).

    POST   /v1/chat/completions   the scripted reply for the conversation it is sent
    GET    /v1/models             the script's model
    GET    /requests              every chat request received, oldest first (for tests)
    DELETE /requests              forget them
    GET    /healthz

    server.py --listen 127.0.0.1:8090 [--scenario refund | --script FILE.json]

The reply is chosen by how many tool results the conversation holds (messages with role
``tool``): the script's turn with the largest ``after`` not above that count. A replayed
conversation therefore gets the same kind of reply, and a journal that replays it asks
nothing. Like the real API, every reply has fresh ids (``chatcmpl-…``, ``call_…``): only a
journal makes a second attempt see the same tool call ids, and so the same call keys.

A script::

    {"model": "mock-refund-1",
     "turns": [{"after": 0, "tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "4711"}}]},
               {"after": 1, "content": "Order {{lookup_order.orderId}} is {{lookup_order.status}}."}]}

``{{tool.field}}`` in a string is replaced by that field of the newest result of that tool
in the conversation (a tool message's JSON content), so a script can pass a refund id on.
``usage`` is computed as the API bills it, roughly: 4 characters a token, and a prompt
whose prefix was sent before counts that prefix as cached in steps of 128 tokens from
1024 on, as OpenAI's prompt caching does.
"""

import argparse
import hashlib
import json
import re
import secrets
import string
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: The refund agent's conversation (examples/refund-agent refund-loop): six tool calls over
#: five turns, the refund (NonIdempotent) in the third, then the answer.
REFUND = {
    "model": "mock-refund-1",
    "turns": [
        {"after": 0, "tool_calls": [{"name": "lookup_order", "arguments": {"order_id": "4711"}}]},
        {"after": 1, "tool_calls": [{"name": "check_policy", "arguments": {
            "order_id": "{{lookup_order.orderId}}", "status": "{{lookup_order.status}}",
            "note": "{{lookup_order.note}}"}}]},
        {"after": 2, "tool_calls": [{"name": "issue_refund", "arguments": {
            "order_id": "{{lookup_order.orderId}}", "amount": "{{lookup_order.amount}}"}}]},
        {"after": 3, "tool_calls": [
            {"name": "get_refund", "arguments": {"refund_id": "{{issue_refund.refundId}}"}},
            {"name": "notify_customer", "arguments": {"customer": "{{lookup_order.customer}}",
                                                      "template": "refund-issued"}}]},
        {"after": 5, "tool_calls": [{"name": "get_refund", "arguments": {
            "refund_id": "{{issue_refund.refundId}}"}}]},
        {"after": 6, "content": "Refunded {{issue_refund.amount}} for order "
                                "{{lookup_order.orderId}} (refund {{issue_refund.refundId}}, "
                                "{{get_refund.state}}); the customer was told by "
                                "{{notify_customer.channel}}."},
    ],
}
SCENARIOS = {"refund": REFUND}

TEMPLATE = re.compile(r"\{\{(\w+)\.(\w+)\}\}")
ALNUM = string.ascii_letters + string.digits


def _id(prefix, n=24):
    return prefix + "".join(secrets.choice(ALNUM) for _ in range(n))


def tool_results(messages):
    """The newest result of each tool, by the name of the call it answers."""
    names, results = {}, {}
    for m in messages:
        for tc in m.get("tool_calls") or []:
            names[tc.get("id")] = (tc.get("function") or {}).get("name")
        if m.get("role") == "tool":
            try:
                results[names.get(m.get("tool_call_id"))] = json.loads(m.get("content") or "null")
            except ValueError:
                pass
    return results


def fill(x, results):
    if isinstance(x, str):
        def one(mt):
            v = (results.get(mt.group(1)) or {})
            v = v.get(mt.group(2), "") if isinstance(v, dict) else ""
            return v if isinstance(v, str) else json.dumps(v)
        return TEMPLATE.sub(one, x)
    if isinstance(x, dict):
        return {k: fill(v, results) for k, v in x.items()}
    if isinstance(x, list):
        return [fill(v, results) for v in x]
    return x


class Model:
    def __init__(self, script):
        self.script = script
        self.turns = sorted(script["turns"], key=lambda t: t["after"])
        self.lock = threading.Lock()
        self.requests = []
        self.prefixes = set()  # digests of message prefixes seen (prompt caching)

    def reply(self, body):
        messages = body.get("messages") or []
        n = sum(1 for m in messages if m.get("role") == "tool")
        turn = [t for t in self.turns if t["after"] <= n][-1]
        results = tool_results(messages)
        if "tool_calls" in turn:
            msg = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                {"id": _id("call_"), "type": "function",
                 "function": {"name": c["name"],
                              "arguments": json.dumps(fill(c["arguments"], results))}}
                for c in turn["tool_calls"]]}
            finish = "tool_calls"
        else:
            msg = {"role": "assistant", "content": fill(turn["content"], results), "refusal": None}
            finish = "stop"
        usage = self.usage(body, messages, msg)
        return {"id": _id("chatcmpl-", 29), "object": "chat.completion", "created": int(time.time()),
                "model": body.get("model") or self.script.get("model", "mock"),
                "system_fingerprint": "fp_mock", "service_tier": "default",
                "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}],
                "usage": usage}

    def usage(self, body, messages, msg):
        tools = json.dumps(body.get("tools") or [], sort_keys=True)
        prompt = (len(tools) + sum(len(json.dumps(m, sort_keys=True)) for m in messages)) // 4 + 3
        cached = 0
        with self.lock:
            size = len(tools)
            for i, m in enumerate(messages):
                size += len(json.dumps(m, sort_keys=True))
                key = hashlib.sha256(json.dumps([tools, messages[:i + 1]], sort_keys=True).encode()).hexdigest()
                if key in self.prefixes:
                    cached = size // 4
                self.prefixes.add(key)
        cached = cached // 128 * 128 if cached >= 1024 else 0
        completion = len(json.dumps(msg)) // 4
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": min(cached, prompt), "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0,
                                              "rejected_prediction_tokens": 0}}


class Handler(BaseHTTPRequestHandler):
    server_version = "mock-model/0.1"

    def log_message(self, fmt, *args):
        if getattr(self.server, "quiet", False):
            return
        print("mock-model:", time.strftime("%H:%M:%S"), self.address_string(), fmt % args,
              flush=True)

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        model = self.server.model
        if self.path == "/requests":
            with model.lock:
                return self._send(200, list(model.requests))
        if self.path == "/v1/models":
            return self._send(200, {"object": "list", "data": [
                {"id": model.script.get("model", "mock"), "object": "model", "owned_by": "mock"}]})
        if self.path == "/healthz":
            return self._send(200, {"ok": True})
        self._send(404, {"error": {"message": f"no route {self.path}", "type": "invalid_request_error"}})

    def do_DELETE(self):
        if self.path != "/requests":
            return self._send(404, {"error": {"message": "not found"}})
        with self.server.model.lock:
            self.server.model.requests.clear()
        self._send(200, {"requests": 0})

    def do_POST(self):
        if self.path.rstrip("/") not in ("/v1/chat/completions", "/chat/completions"):
            return self._send(404, {"error": {"message": f"no route {self.path}",
                                              "type": "invalid_request_error"}})
        n = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return self._send(400, {"error": {"message": "the body is not JSON",
                                              "type": "invalid_request_error"}})
        if body.get("stream"):
            return self._send(400, {"error": {"message": "the mock does not stream",
                                              "type": "invalid_request_error"}})
        model = self.server.model
        reply = model.reply(body)
        with model.lock:
            model.requests.append({"n": len(model.requests), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                   "body": body, "reply": reply})
        self._send(200, reply)


def serve(script, host="127.0.0.1", port=0, quiet=True):
    """A running server (in a thread): ``srv.url`` is its base URL with /v1."""
    srv = ThreadingHTTPServer((host, port), Handler)
    srv.quiet = quiet
    srv.model = Model(script)
    srv.url = f"http://{host}:{srv.server_address[1]}/v1"
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    return srv


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:8090", help="host:port")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--scenario", default="refund", choices=sorted(SCENARIOS))
    g.add_argument("--script", help="a JSON script (see the module's doc)")
    a = p.parse_args()
    if a.script:
        with open(a.script, encoding="utf-8") as f:
            script = json.load(f)
    else:
        script = SCENARIOS[a.scenario]
    host, port = a.listen.rsplit(":", 1)
    srv = ThreadingHTTPServer((host, int(port)), Handler)
    srv.model = Model(script)
    print(f"mock-model: {len(script['turns'])} turns of {script.get('model', 'mock')}, "
          f"listening on {host}:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

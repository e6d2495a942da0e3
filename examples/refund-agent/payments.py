#!/usr/bin/env python3
"""A small local payments service for the refund-agent example (standard library only).

It knows a few orders and keeps refunds and notifications in memory. Every request that
changes something must carry an ``Idempotency-Key``: a repeat with the same key returns
the first answer (header ``Idempotent-Replayed: true``) instead of acting again, which is
what makes a rerun of an agent step with the same key harmless.

    GET  /orders/<id>                 the order (amount, status, customer)
    POST /refunds                     {"orderId", "amount"}; 201 a new refund, 200 a replay
    GET  /refunds/<id>                one refund; "pending" until --settle-seconds have passed
    GET  /refunds?idempotencyKey=<k>  the refund made with that key, or 404: what a verify
                                      probe asks
    POST /refunds/<id>/reversal       reverse a refund (the compensation)
    POST /notifications               {"customer", "template"}; de-duplicated by key
    POST /payouts                     {"expenseId", "employee", "amount"}: an expense reimbursed
    GET  /ledger                      everything that happened: refunds, payouts and, per key,
                                      how many requests carried it (what tests count)
    PUT  /stall                       {"paths": ["/refunds"]}: a change under these paths is
                                      made, and its answer held until the next PUT /stall (a
                                      call that acted and was lost before its caller heard)
    PUT  /outage                      {"paths": ["/notifications"]}: requests under these
                                      paths answer 503 until the next PUT (a provider that is
                                      down, for demos and tests; [] ends it)
    GET  /healthz

    payments.py --listen 127.0.0.1:8080 [--settle-seconds 0]
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ORDERS = {
    "4711": {"orderId": 4711, "amount": "23.90 EUR", "status": "delivered",
             "customer": "c-1029", "note": "item arrived damaged"},
    "4712": {"orderId": 4712, "amount": "129.00 EUR", "status": "shipped",
             "customer": "c-2044", "note": ""},
}


class Ledger:
    def __init__(self, settle_seconds):
        self.lock = threading.Lock()
        self.settle = settle_seconds
        self.refunds = {}  # id -> refund
        self.by_key = {}  # (kind, key) -> (status, body)
        self.requests = {}  # key -> count of mutating requests carrying it
        self.notifications = []
        self.payouts = []
        self.outage = []  # path prefixes answering 503
        self.stalled = []  # path prefixes whose answers are held
        self.release = threading.Event()

    def snapshot(self):
        with self.lock:
            return {
                "refunds": [self._view(r) for r in self.refunds.values()],
                "notifications": list(self.notifications),
                "payouts": list(self.payouts),
                "requestsByKey": dict(self.requests),
            }

    def _view(self, r):
        r = dict(r)
        if r["state"] == "pending" and time.time() >= r.pop("settlesAt"):
            r["state"] = "succeeded"
        r.pop("settlesAt", None)
        return r

    def once(self, kind, key, make):
        """Runs make() for the first request with this key; replays its answer after."""
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + 1
            if (kind, key) in self.by_key:
                status, body = self.by_key[(kind, key)]
                return status, body, True
            status, body = make()
            if status < 400:
                self.by_key[(kind, key)] = (200, body)
            return status, body, False


class Handler(BaseHTTPRequestHandler):
    server_version = "payments/0.1"

    def log_message(self, fmt, *args):
        print("payments:", time.strftime("%H:%M:%S"), self.address_string(), fmt % args, flush=True)

    def _send(self, status, body, replayed=False):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if replayed:
            self.send_header("Idempotent-Replayed", "true")
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return None

    def _down(self):
        """Answers 503 when the path is under an outage; whether it did."""
        path = self.path.partition("?")[0]
        with self.server.ledger.lock:
            down = any(path.startswith(p) for p in self.server.ledger.outage)
        if down:
            self._send(503, {"error": "the provider is unavailable"})
        return down

    def do_PUT(self):
        body = self._body()
        paths = body.get("paths") if isinstance(body, dict) else None
        if self.path not in ("/outage", "/stall") or not isinstance(paths, list):
            return self._send(400, {"error": 'PUT /outage or /stall {"paths": [...]}'})
        led = self.server.ledger
        with led.lock:
            if self.path == "/outage":
                led.outage = [str(p) for p in paths]
            else:
                # Answers held so far go out; new ones are held under `paths`.
                led.release.set()
                led.release = threading.Event()
                led.stalled = [str(p) for p in paths]
        self._send(200, {self.path.strip("/"): paths})

    def _hold(self):
        """Holds the answer of a change under a stalled path until released."""
        path = self.path.partition("?")[0]
        with self.server.ledger.lock:
            held = any(path.startswith(p) for p in self.server.ledger.stalled)
            release = self.server.ledger.release
        if held:
            release.wait(timeout=600)

    def do_GET(self):
        if self._down():
            return
        led = self.server.ledger
        path, _, query = self.path.partition("?")
        parts = path.strip("/").split("/")
        if parts == ["refunds"] and query.startswith("idempotencyKey="):
            key = query.split("=", 1)[1]
            with led.lock:
                found = [led._view(r) for r in led.refunds.values() if r["idempotencyKey"] == key]
            return self._send(200, found[0]) if found else self._send(404, {"error": "no refund with that key"})
        if parts == ["healthz"]:
            return self._send(200, {"ok": True})
        if parts == ["ledger"]:
            return self._send(200, led.snapshot())
        if len(parts) == 2 and parts[0] == "orders":
            order = ORDERS.get(parts[1])
            return self._send(200, order) if order else self._send(404, {"error": "no such order"})
        if len(parts) == 2 and parts[0] == "refunds":
            with led.lock:
                r = led.refunds.get(parts[1])
                r = led._view(r) if r else None
            return self._send(200, r) if r else self._send(404, {"error": "no such refund"})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        if self._down():
            return
        led = self.server.ledger
        key = self.headers.get("Idempotency-Key")
        if not key:
            return self._send(400, {"error": "Idempotency-Key header is required"})
        body = self._body()
        if not isinstance(body, dict):
            return self._send(400, {"error": "body must be a JSON object"})
        parts = self.path.strip("/").split("/")
        trace = self.headers.get("traceparent")

        if parts == ["refunds"]:
            def make():
                order = ORDERS.get(str(body.get("orderId")))
                if not order:
                    return 404, {"error": "no such order"}
                if body.get("amount") != order["amount"]:
                    return 422, {"error": f"amount must be {order['amount']}"}
                rid = f"re_{len(led.refunds) + 1:04d}"
                led.refunds[rid] = {"id": rid, "orderId": order["orderId"], "amount": order["amount"],
                                    "state": "pending", "idempotencyKey": key, "traceparent": trace,
                                    "settlesAt": time.time() + led.settle}
                return 201, led._view(led.refunds[rid])
            status, out, replayed = led.once("refund", key, make)
            if replayed and "id" in out:
                with led.lock:
                    out = led._view(led.refunds[out["id"]])
            self._hold()
            return self._send(status, out, replayed)

        if len(parts) == 3 and parts[0] == "refunds" and parts[2] == "reversal":
            def make():
                r = led.refunds.get(parts[1])
                if not r:
                    return 404, {"error": "no such refund"}
                r["state"] = "reversed"
                return 200, {"id": r["id"], "state": "reversed"}
            status, out, replayed = led.once("reversal", key, make)
            return self._send(status, out, replayed)

        if parts == ["payouts"]:
            def make():
                if not body.get("expenseId") or not body.get("amount"):
                    return 422, {"error": "expenseId and amount are required"}
                pid = f"po_{len(led.payouts) + 1:04d}"
                led.payouts.append({"id": pid, "expenseId": body["expenseId"],
                                    "employee": body.get("employee"), "amount": body["amount"],
                                    "idempotencyKey": key})
                return 201, {"id": pid, "state": "paid"}
            status, out, replayed = led.once("payout", key, make)
            return self._send(status, out, replayed)

        if parts == ["notifications"]:
            def make():
                mid = f"msg-{len(led.notifications) + 1:05d}"
                led.notifications.append({"id": mid, "customer": body.get("customer"),
                                          "template": body.get("template"), "idempotencyKey": key})
                return 201, {"id": mid, "channel": "email"}
            status, out, replayed = led.once("notification", key, make)
            return self._send(status, out, replayed)

        self._send(404, {"error": "not found"})


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:8080", help="host:port")
    p.add_argument("--settle-seconds", type=float, default=0.0,
                   help="how long a new refund stays pending")
    a = p.parse_args()
    host, port = a.listen.rsplit(":", 1)
    srv = ThreadingHTTPServer((host, int(port)), Handler)
    srv.ledger = Ledger(a.settle_seconds)
    print(f"payments: listening on {host}:{srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

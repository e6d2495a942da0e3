#!/usr/bin/env python3
"""make demo's notification receiver: prints every approval notification the operator
sends to its `json` channel, after checking the body's HMAC-SHA256 signature
(`X-AgentRun-Signature` over `<X-AgentRun-Timestamp>.<body>`, docs/notifications.md) with the key the channel's Secret holds.

    demo-receiver.py --listen 127.0.0.1:18090 --hmac-key KEY
"""

import argparse
import hashlib
import hmac
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        given = self.headers.get("X-AgentRun-Signature", "")
        signed_over = self.headers.get("X-AgentRun-Timestamp", "").encode() + b"." + body
        want = "sha256=" + hmac.new(self.server.key, signed_over, hashlib.sha256).hexdigest()
        signed = hmac.compare_digest(given, want)
        self.send_response(200 if signed else 401)
        self.send_header("Content-Length", "0")
        self.end_headers()
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        a = doc.get("approval") or {}
        line = (f"notification {doc.get('event', '?')}: run {doc.get('run', {}).get('name')} "
                f"step {doc.get('step')} — {a.get('question')!r} phase={a.get('phase')}")
        if a.get("decidedBy"):
            line += f" decided by {a['decidedBy']} ({a.get('decision')}: {a.get('comment')!r})"
        line += " [signature ok]" if signed else " [BAD SIGNATURE: refused]"
        print(line, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:18090")
    p.add_argument("--hmac-key", required=True)
    a = p.parse_args()
    host, port = a.listen.rsplit(":", 1)
    srv = ThreadingHTTPServer((host, int(port)), Receiver)
    srv.key = a.hmac_key.encode()
    print(f"receiver: listening on {a.listen}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()

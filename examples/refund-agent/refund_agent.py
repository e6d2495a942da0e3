#!/usr/bin/env python3
"""The refund agent of config/samples/agentrun_refund.yaml, one subcommand per step.

    refund_agent.py lookup-order --order-id=4711
    refund_agent.py draft-refund
    refund_agent.py issue-refund --from-context=draft-refund
    refund_agent.py reverse-refund --from-context=issue-refund
    refund_agent.py notify-customer --template=refund-issued

Each reads its inputs from the step context (agentrun_step SDK), talks to the payments
service at $PAYMENTS_API_URL with the step's idempotency key, and reports its result in the
termination message. A failed call exits non-zero: the attempt fails and is retried with
the same key, which the payments service answers with the first result. A request the
service refused (a 4xx answer) did not act, and the step says so (`"effect": "NotApplied"`);
any other failure may have acted, and for issue-refund (NonIdempotent) the operator asks a
person before it runs again.

draft-refund stands in for an LLM call: it applies the refund policy as a rule and reports
the tokens a model call over the same prompt would be billed (prompt and answer length / 4),
so budgets and token accounting see realistic numbers without a model.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from agentrun_step import Step, StepError


class Refused(StepError):
    """The service answered 4xx: it refused the request, so nothing changed."""


def call(method, url, body=None, headers=None, timeout=10):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp), resp.headers.get("Idempotent-Replayed") == "true"
    except urllib.error.HTTPError as e:
        text = f"{method} {url}: {e.code} {e.read()[:200].decode(errors='replace')}"
        raise (Refused if 400 <= e.code < 500 else StepError)(text) from None
    except (urllib.error.URLError, OSError) as e:
        raise StepError(f"{method} {url}: {getattr(e, 'reason', e)}") from None


def api():
    url = os.environ.get("PAYMENTS_API_URL")
    if not url:
        raise StepError("PAYMENTS_API_URL is not set")
    return url.rstrip("/")


def lookup_order(step, a):
    order, _ = call("GET", f"{api()}/orders/{a.order_id}")
    return {k: order[k] for k in ("orderId", "amount", "status", "customer", "note")}, None


def draft_refund(step, a):
    order = step.result_of("lookup-order")
    prompt = (f"Policy: refund delivered orders in full when the item arrived damaged.\n"
              f"Order: {json.dumps(order)}\nPropose amount and reason as JSON.")
    if order["status"] == "delivered" and "damaged" in order.get("note", ""):
        draft = {"orderId": order["orderId"], "amount": order["amount"],
                 "reason": "item arrived damaged", "confidence": 0.92}
    else:
        draft = {"orderId": order["orderId"], "amount": "0.00 EUR",
                 "reason": "policy does not cover this order", "confidence": 0.6}
    tokens = {"input": len(prompt) // 4, "output": len(json.dumps(draft)) // 4}
    return draft, tokens


def issue_refund(step, a):
    draft = step.result_of(a.from_context)
    refund, replayed = call("POST", f"{api()}/refunds",
                            {"orderId": draft["orderId"], "amount": draft["amount"]},
                            headers=step.headers())
    print(f"refund {refund['id']} {'replayed' if replayed else 'created'} "
          f"for key {step.idempotency_key}", flush=True)
    # A refund settles asynchronously; the step reports it once it has.
    deadline = time.monotonic() + a.settle_timeout
    # Polling is a read: a failed poll is retried until the deadline.
    while refund["state"] == "pending":
        if time.monotonic() > deadline:
            raise StepError(f"refund {refund['id']} still pending after {a.settle_timeout}s")
        time.sleep(0.5)
        try:
            refund, _ = call("GET", f"{api()}/refunds/{refund['id']}", timeout=5)
        except StepError as e:
            print(f"polling refund {refund['id']}: {e}; retrying", flush=True)
    return {"refundId": refund["id"], "orderId": refund["orderId"], "amount": refund["amount"],
            "state": refund["state"], "replayed": replayed}, None


def reverse_refund(step, a):
    refund = step.result_of(a.from_context)
    out, _ = call("POST", f"{api()}/refunds/{refund['refundId']}/reversal", {},
                  headers=step.headers())
    return {"refundId": out["id"], "state": out["state"]}, None


def notify_customer(step, a):
    order = step.result_of("lookup-order")
    out, _ = call("POST", f"{api()}/notifications",
                  {"customer": order["customer"], "template": a.template}, headers=step.headers())
    return {"messageId": out["id"], "channel": out["channel"]}, None


def main(argv=None):
    p = argparse.ArgumentParser(prog="refund-agent")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("lookup-order"); s.add_argument("--order-id", required=True)
    s.set_defaults(fn=lookup_order)
    s = sub.add_parser("draft-refund"); s.set_defaults(fn=draft_refund)
    s = sub.add_parser("issue-refund"); s.add_argument("--from-context", default="draft-refund")
    s.add_argument("--settle-timeout", type=float, default=60.0); s.set_defaults(fn=issue_refund)
    s = sub.add_parser("reverse-refund"); s.add_argument("--from-context", default="issue-refund")
    s.set_defaults(fn=reverse_refund)
    s = sub.add_parser("notify-customer"); s.add_argument("--template", default="refund-issued")
    s.set_defaults(fn=notify_customer)
    a = p.parse_args(argv)

    try:
        step = Step.load()
    except StepError as e:
        print(f"refund-agent: {e}", file=sys.stderr)
        return 2
    print(f"refund-agent {a.cmd}: run {step.run} step {step.step} attempt {step.attempt} "
          f"key {step.idempotency_key}", flush=True)
    try:
        result, tokens = a.fn(step, a)
    except Refused as e:
        step.fail(e, not_applied=True)
    except StepError as e:
        step.fail(e)
    step.succeed(result, tokens=tokens)
    print(f"refund-agent {a.cmd}: {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

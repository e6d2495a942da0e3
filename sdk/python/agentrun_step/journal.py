"""The step journal (docs/journal.md, D19): every model call and tool call a step makes is
recorded in ``StepJournal`` chunks before the loop goes on, and a new attempt of the same
(run, step, plan revision) replays what was recorded instead of asking or calling again.

::

    step Pod (attempt n, its Pod-bound token) --GET/POST/PUT--> StepJournal <prefix><k>
        chunk k: spec.entries seq firstSeq.. (at most 32, 256 KiB), sealed when full
    operator --writes--> status.settlements (a call that may have acted, settled)

    journal = step.journal                       # opened from the environment
    answer = journal.model(request, lambda req: (ask_model(req), tokens))
    refund = journal.tool(tool_call_id, "issue_refund", args, "NonIdempotent",
                          lambda key: payments.refund(args, idempotency_key=key))

Calls are made one at a time, in the loop's order: a position in the journal is the call's
place in that order, so the journal is not for calls made from several threads at once.

Standard library only. How this module reads the protocol where docs/journal.md leaves a
choice: the takeover is its own write, made before the first call this attempt makes (not
replays), so an older attempt is fenced before this one acts; a chunk whose last entry may
still change (an ``Intent``, or a ``NotApplied`` at the end of the journal) is not sealed
until it cannot (the write of its answer, or the write that opens the next chunk seals
it); an entry that may still change is placed only where its chunk keeps room for the
largest answer (128 KiB), so an answer never pushes a chunk past 256 KiB; a call run again
after a ``NotApplied`` settlement or record writes its ``Intent`` again (NonIdempotent
tools) with this attempt's number before it starts, so an attempt lost during the rerun
is seen by the operator as the one with an open intent.
"""

import hashlib
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request

from . import StepError

__all__ = ["Journal", "JournalError", "JournalMismatch", "JournalUnknown", "JournalTakenOver",
           "JournalFull", "EntryTooLarge", "JournalRefused", "NotApplied", "call_key",
           "canonical_json", "digest", "entry_bytes", "TOOL_EFFECTS"]

API_VERSION = "agentrun.dev/v1alpha1"
#: Most entries one chunk holds.
CHUNK_MAX_ENTRIES = 32
#: Most recorded bytes one chunk holds.
CHUNK_MAX_BYTES = 256 << 10
#: Longest recorded answer of one call, in bytes.
ENTRY_MAX_BYTES = 128 << 10
#: Default of steps[].journal.maxBytes.
DEFAULT_MAX_BYTES = 1 << 20
#: Longest recorded reason a call did not act (the CRD's bound; a reason is cut, an answer never).
ERROR_MAX_CHARS = 4096
CALL_ID_MAX_CHARS = 256
NAME_MAX_CHARS = 256
#: What a tool may declare it does to the outside world.
TOOL_EFFECTS = ("None", "Idempotent", "NonIdempotent")

ENV_JOURNAL = "AGENTRUN_JOURNAL"
ENV_MAX_BYTES = "AGENTRUN_JOURNAL_MAX_BYTES"
ENV_RUN_UID = "AGENTRUN_RUN_UID"
ENV_NAMESPACE = "AGENTRUN_NAMESPACE"
ENV_TOKEN_FILE = "AGENTRUN_JOURNAL_TOKEN_FILE"
ENV_CA_FILE = "AGENTRUN_JOURNAL_CA_FILE"
DEFAULT_TOKEN_FILE = "/var/run/agentrun/journal/token"
DEFAULT_CA_FILE = "/var/run/agentrun/journal/ca.crt"


class JournalError(StepError):
    """The journal cannot be read or written, or does not hold what the protocol says."""


class JournalMismatch(JournalError):
    """The loop asks something other than what the journal recorded at this position."""

    def __init__(self, seq, recorded, asked):
        self.seq, self.recorded, self.asked = seq, recorded, asked
        super().__init__(
            f"journal position {seq}: attempt {recorded.get('attempt')} recorded "
            f"{_describe(recorded)}, but this attempt asks {_describe(asked)}; the prompt, the "
            "tools or the code changed since, and a replay never mixes old answers with new "
            "questions (a changed step needs a new plan revision)")


class JournalUnknown(JournalError):
    """A NonIdempotent call was started and never answered: it may have acted."""

    def __init__(self, seq, entry):
        self.seq, self.entry = seq, entry
        super().__init__(
            f"journal position {seq}: tool call {entry.get('callId')!r} ({entry.get('name')}, key "
            f"{entry.get('key')}) was started by attempt {entry.get('attempt')} and never answered, "
            "so it may have acted; it is settled (the step's verify probe or a Reconcile "
            "approval) before the step runs again")


class JournalTakenOver(JournalError):
    """A newer attempt of this step has taken the journal over: this one stops."""

    def __init__(self, attempt, newer, detail=""):
        self.attempt, self.newer = attempt, newer
        tail = f" ({detail})" if detail else ""
        super().__init__(
            f"attempt {newer} has taken this step's journal over; attempt {attempt} stops "
            f"without recording more{tail}")


class JournalFull(JournalError):
    """The call's entry would take the journal past its maxBytes."""

    def __init__(self, seq, used, size, limit):
        self.seq, self.used, self.size, self.limit = seq, used, size, limit
        super().__init__(
            f"journal position {seq}: recording this call ({size} bytes) would take the journal "
            f"to {used + size} bytes, past its maxBytes of {limit} (it holds {used}); raise "
            "steps[].journal.maxBytes (at most 8 MiB) or make the step do less")


class EntryTooLarge(JournalError):
    """One call's answer is longer than an entry may hold (128 KiB)."""

    def __init__(self, seq, call_id, size, limit=ENTRY_MAX_BYTES):
        self.seq, self.call_id, self.size, self.limit = seq, call_id, size, limit
        super().__init__(
            f"journal position {seq}: the answer of call {call_id!r} is {size} bytes, over the "
            f"{limit}-byte limit of one journal entry; it is never cut: return a reference "
            "(an object key) instead of the data")


class JournalRefused(JournalError):
    """The API server refused a journal write or read for a reason other than a takeover."""

    def __init__(self, what, code, message):
        self.code, self.server_message = code, message
        super().__init__(f"{what}: the API server answered {code}: {message}")


class NotApplied(Exception):
    """Raised by a tool function: the tool did not act (a refused request). The journal
    records it, and the exception goes on to the loop."""


def canonical_json(x):
    """The bytes a digest is taken over: sorted keys, no spaces, UTF-8."""
    return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def digest(x):
    return hashlib.sha256(canonical_json(x)).hexdigest()


def call_key(step_key, call_id):
    """A tool call's own idempotency key: the first 128 bits of sha256(K || 0x00 || id), hex."""
    return hashlib.sha256(step_key.encode("utf-8") + b"\0" + call_id.encode("utf-8")).hexdigest()[:32]


def _text(x):
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def _utf8_len(s):
    return len(s.encode("utf-8")) if s else 0


def entry_bytes(e):
    """What an entry counts against maxBytes: its ids, digest, key, name, response and error."""
    return sum(_utf8_len(e.get(f)) for f in ("callId", "requestDigest", "key", "name",
                                             "response", "error"))


def _describe(e):
    return (f"{e.get('kind', '?').lower()} call {e.get('callId')!r} with request digest "
            f"{str(e.get('requestDigest'))[:16]}…")


def _tokens(t):
    t = t or {}
    out = {}
    for k in ("input", "output", "cached"):
        v = t.get(k) or 0
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise JournalError(f"tokens.{k} must be a non-negative integer, got {v!r}")
        out[k] = v
    return out


def _recorded_tokens(t):
    out = {"input": t["input"], "output": t["output"]}
    if t["cached"]:
        out["cached"] = t["cached"]
    return out


class _Api:
    """GET, POST and PUT of stepjournals in one namespace, with a bearer token read per
    request (a projected token is rotated in place)."""

    def __init__(self, base, namespace, token=None, token_file=None, ca_file=None,
                 ssl_context=None, timeout=30.0, sleep=time.sleep, tries=4):
        self.base = base.rstrip("/")
        self.path = (f"/apis/{API_VERSION}/namespaces/{urllib.parse.quote(namespace)}/stepjournals")
        self.token, self.token_file = token, token_file
        if ssl_context is None and self.base.startswith("https:"):
            ssl_context = ssl.create_default_context(cafile=ca_file)
        self.ctx, self.timeout, self.sleep, self.tries = ssl_context, timeout, sleep, tries

    def _token(self):
        if self.token_file:
            try:
                with open(self.token_file, encoding="utf-8") as f:
                    return f.read().strip()
            except OSError as e:
                raise JournalError(f"cannot read the journal token {self.token_file}: "
                                   f"{e.strerror}") from None
        return self.token

    def request(self, method, name=None, body=None):
        """(status, decoded body); retries what may pass on a second try (5xx, 429, no answer)."""
        url = self.base + self.path + (f"/{urllib.parse.quote(name)}" if name else "")
        data = None if body is None else json.dumps(body, separators=(",", ":"),
                                                    ensure_ascii=False).encode("utf-8")
        last = None
        for i in range(self.tries):
            if i:
                self.sleep(0.2 * 2 ** i)
            headers = {"Accept": "application/json"}
            if data is not None:
                headers["Content-Type"] = "application/json"
            token = self._token()
            if token:
                headers["Authorization"] = f"Bearer {token}"
            req = urllib.request.Request(url, data=data, method=method, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout, context=self.ctx) as resp:
                    return resp.status, json.loads(resp.read() or b"{}")
            except urllib.error.HTTPError as e:
                raw = e.read()
                try:
                    out = json.loads(raw or b"{}")
                except ValueError:
                    out = {"message": raw[:400].decode("utf-8", "replace")}
                if e.code in (429, 500, 502, 503, 504):
                    last = f"{e.code} {out.get('message', '')}"
                    continue
                return e.code, out
            except (urllib.error.URLError, OSError) as e:
                last = str(getattr(e, "reason", e))
        raise JournalError(f"{method} {url}: no answer after {self.tries} tries: {last}")


class Journal:
    """One step attempt's view of its journal: what was recorded, where this attempt is in
    the loop, and the writes that record the calls it makes."""

    def __init__(self, api_url, namespace, prefix, run, run_uid, step, plan_revision, attempt,
                 step_key, *, token=None, token_file=None, ca_file=None, ssl_context=None,
                 max_bytes=DEFAULT_MAX_BYTES, clock=time.time, sleep=time.sleep, timeout=30.0):
        self.api = _Api(api_url, namespace, token, token_file, ca_file, ssl_context, timeout,
                        sleep)
        self.namespace, self.prefix = namespace, prefix
        self.run, self.run_uid, self.step = run, run_uid, step
        self.plan_revision, self.attempt = int(plan_revision), int(attempt)
        self.step_key, self.max_bytes, self.clock = step_key, int(max_bytes), clock
        self.loaded = False
        self._chunks = []    # the chunk objects as last read or written, in order
        self._entries = []   # every recorded entry, by seq
        self._settled = {}   # (seq, attempt of the intent) -> settlement
        self._owner = False  # this attempt has taken the journal over
        self._pos = 0
        #: Calls answered from the journal / made by this attempt.
        self.replayed = 0
        self.new = 0
        self._spent = {"input": 0, "output": 0, "cached": 0}
        self._unrecorded = {"input": 0, "output": 0, "cached": 0}

    @classmethod
    def from_env(cls, env=None, **kw):
        """The journal of this step attempt, from what the operator gives a journaled Pod."""
        env = os.environ if env is None else env

        def need(name):
            v = env.get(name)
            if not v:
                raise JournalError(f"{name} is not set: the step has no journal (set "
                                   "`journal: {}` on the step) or this is not a step Pod")
            return v

        prefix = need(ENV_JOURNAL)
        host, port = need("KUBERNETES_SERVICE_HOST"), need("KUBERNETES_SERVICE_PORT")
        if ":" in host:
            host = f"[{host}]"
        try:
            max_bytes = int(env.get(ENV_MAX_BYTES) or DEFAULT_MAX_BYTES)
        except ValueError:
            raise JournalError(f"{ENV_MAX_BYTES} must be an integer, "
                               f"got {env.get(ENV_MAX_BYTES)!r}") from None
        return cls(f"https://{host}:{port}", need(ENV_NAMESPACE), prefix, need("AGENTRUN_RUN"),
                   need(ENV_RUN_UID), need("AGENTRUN_STEP"), need("AGENTRUN_PLAN_REVISION"),
                   need("AGENTRUN_ATTEMPT"), need("AGENTRUN_IDEMPOTENCY_KEY"),
                   token_file=env.get(ENV_TOKEN_FILE) or DEFAULT_TOKEN_FILE,
                   ca_file=env.get(ENV_CA_FILE) or DEFAULT_CA_FILE, max_bytes=max_bytes, **kw)

    # ------------------------------------------------------------------ what callers use

    def call_key(self, call_id):
        return call_key(self.step_key, call_id)

    @property
    def position(self):
        """The position the next call takes."""
        return self._pos

    @property
    def recorded(self):
        """How many calls the journal holds."""
        return len(self._entries)

    def tokens_new(self):
        """Tokens this attempt's model calls spent (replayed calls spend none)."""
        return dict(self._spent)

    def tokens_total(self):
        """Tokens of every model call the journal holds, each once, whichever attempt made
        it: the step reports this (``journalTokens``) so the run counts the journal whole
        even when the attempt ends before the operator has seen its last entries."""
        t = {"input": 0, "output": 0}
        for e in self._entries:
            got = e.get("tokens") or {}
            t["input"] += int(got.get("input") or 0)
            t["output"] += int(got.get("output") or 0)
        return t

    def tokens_unrecorded(self):
        """Tokens spent on calls whose answer could not be recorded (refused as too large,
        or the journal was taken over): the step reports these itself."""
        return dict(self._unrecorded)

    def model(self, request, call, *, call_id=None, name=None):
        """A model call: the recorded answer when this position holds one, else
        ``call(request) -> (response, tokens)`` and its answer recorded."""
        self.load()
        p = self._pos
        cid = call_id or f"model-{p}"
        asked = {"callId": cid, "kind": "Model", "requestDigest": digest(request)}
        rec = self._at(p, asked)
        if rec is not None:
            if rec["state"] != "Done":
                raise JournalError(f"journal position {p}: a model call in state "
                                   f"{rec['state']!r} (only Done is recorded for a model call)")
            return self._replay(json.loads(rec["response"]))
        self._check_call_id(cid)
        self._take_over()
        started = self._now()
        response, tokens = call(request)
        t = _tokens(tokens)
        for k in t:
            self._spent[k] += t[k]
        self.new += 1
        entry = {**asked, "seq": p, "state": "Done", "attempt": self.attempt,
                 "response": _text(response), "tokens": _recorded_tokens(t),
                 "startedAt": started, "finishedAt": self._now()}
        model_name = name or (request.get("model") if isinstance(request, dict) else None)
        if model_name:
            entry["name"] = str(model_name)[:NAME_MAX_CHARS]
        try:
            self._check_size(entry)
            filled = self._put(entry)
        except JournalError:
            for k in t:
                self._unrecorded[k] += t[k]
            raise
        if filled is not None:  # another writer recorded this position first: its answer wins
            for k in t:
                self._unrecorded[k] += t[k]
            return self._replay(json.loads(filled["response"]))
        self._pos += 1
        return json.loads(entry["response"])

    def tool(self, call_id, name, args, effect, call):
        """A tool call: the recorded result when this position holds one, else
        ``call(key)`` with the call's own key, and its result recorded. A NonIdempotent
        tool's intent is recorded before ``call`` starts; ``call`` raising ``NotApplied``
        records that the tool did not act, and the exception goes on."""
        if effect not in TOOL_EFFECTS:
            raise JournalError(f"effect must be one of {', '.join(TOOL_EFFECTS)}, got {effect!r}")
        self.load()
        p = self._pos
        asked = {"callId": call_id, "kind": "Tool",
                 "requestDigest": digest({"name": name, "args": args})}
        rec = self._at(p, asked)
        if rec is not None:
            state = rec["state"]
            if state == "Done":
                return self._replay(json.loads(rec["response"]))
            if state == "Intent":
                s = self._settled.get((p, rec.get("attempt")))
                if s is None:
                    raise JournalUnknown(p, rec)
                if s.get("outcome") == "Applied":
                    if s.get("response"):
                        return self._replay(json.loads(s["response"]))
                    return self._replay({"settled": "Applied", "by": s.get("by")})
                # settled NotApplied: the call is made again, with the same key, at p
            elif state == "NotApplied" and p < len(self._entries) - 1:
                self._replay(None)
                raise NotApplied(rec.get("error") or "the tool did not act")
            # NotApplied at the end of the journal: the call is made again at p
        else:
            self._check_call_id(call_id)
        return self._run_tool(p, asked, name, args, effect, call)

    def load(self):
        """Reads every chunk and its settlements (once; calls do it themselves)."""
        if not self.loaded:
            self._reload()
            self.loaded = True
        return self

    # ------------------------------------------------------------------ replay

    def _at(self, p, asked):
        """The entry recorded at p, checked against what is asked; None past the end."""
        if p >= len(self._entries):
            return None
        rec = self._entries[p]
        if any(rec.get(k) != asked[k] for k in ("callId", "kind", "requestDigest")):
            raise JournalMismatch(p, rec, asked)
        return rec

    def _replay(self, value):
        self._pos += 1
        self.replayed += 1
        return value

    def _run_tool(self, p, asked, name, args, effect, call):
        key = self.call_key(asked["callId"])
        self._take_over()
        base = {**asked, "seq": p, "effect": effect, "key": key,
                "name": str(name)[:NAME_MAX_CHARS], "attempt": self.attempt,
                "startedAt": self._now()}
        if effect == "NonIdempotent":
            intent = {**base, "state": "Intent"}
            self._check_size(intent)
            filled = self._put(intent)
            if filled is not None:
                raise JournalError(f"journal position {p} was recorded by another writer while "
                                   "this attempt recorded its intent")
        try:
            result = call(key)
        except NotApplied as e:
            self.new += 1
            entry = {**base, "state": "NotApplied", "error": str(e)[:ERROR_MAX_CHARS],
                     "finishedAt": self._now()}
            self._check_size(entry)
            self._put(entry)
            self._pos += 1
            raise
        self.new += 1
        entry = {**base, "state": "Done", "response": _text(result), "finishedAt": self._now()}
        self._check_size(entry)
        filled = self._put(entry)
        if filled is not None:
            return self._replay(json.loads(filled["response"]))
        self._pos += 1
        return json.loads(entry["response"])

    # ------------------------------------------------------------------ bounds

    def _check_call_id(self, call_id):
        if not call_id or len(call_id) > CALL_ID_MAX_CHARS:
            raise JournalError(f"a call id is 1 to {CALL_ID_MAX_CHARS} characters, got "
                               f"{len(call_id or '')}")

    def _check_size(self, entry):
        p = entry["seq"]
        answer = _utf8_len(entry.get("response"))
        if answer > ENTRY_MAX_BYTES:
            raise EntryTooLarge(p, entry["callId"], answer)
        used = sum(entry_bytes(e) for e in self._entries)
        if p < len(self._entries):
            used -= entry_bytes(self._entries[p])
        size = entry_bytes(entry)
        if used + size > self.max_bytes:
            raise JournalFull(p, used, size, self.max_bytes)

    # ------------------------------------------------------------------ reading

    def _name(self, k):
        return f"{self.prefix}{k}"

    def _reload(self):
        """Reads the chunks from 0 until one is missing, and checks they are this step's."""
        chunks, entries, settled = [], [], {}
        k = 0
        while True:
            code, obj = self.api.request("GET", self._name(k))
            if code == 404:
                break
            if code != 200:
                raise self._refused(f"reading journal chunk {self._name(k)}", code, obj)
            spec = obj.get("spec") or {}
            want = {"runUid": self.run_uid, "step": self.step,
                    "planRevision": self.plan_revision, "chunk": k, "firstSeq": len(entries)}
            for f, v in want.items():
                if spec.get(f) != v:
                    raise JournalError(f"journal chunk {self._name(k)} has spec.{f} "
                                       f"{spec.get(f)!r}, expected {v!r}")
            for i, e in enumerate(spec.get("entries") or []):
                if e.get("seq") != len(entries):
                    raise JournalError(f"journal chunk {self._name(k)} entry {i} has seq "
                                       f"{e.get('seq')!r}, expected {len(entries)}")
                entries.append(e)
            for s in (obj.get("status") or {}).get("settlements") or []:
                # A settlement answers the intent of one attempt: an intent
                # written again by a later attempt is a new question.
                settled[(s.get("seq"), s.get("attempt"))] = s
            chunks.append(obj)
            k += 1
        self._chunks, self._entries, self._settled = chunks, entries, settled
        newer = max((c["spec"].get("attempt", 0) for c in chunks), default=0)
        if newer > self.attempt:
            raise JournalTakenOver(self.attempt, newer)

    def _refused(self, what, code, obj, after_write=False):
        msg = obj.get("message") or obj.get("reason") or ""
        if after_write and code in (403, 422):
            # A fence (the CRD's attempt rule, the policy): is there a newer attempt?
            try:
                self._reload()
            except JournalTakenOver as e:
                return JournalTakenOver(self.attempt, e.newer, msg)
        return JournalRefused(what, code, msg)

    # ------------------------------------------------------------------ writing

    def _now(self):
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.clock()))

    def _chunk(self, k, first_seq, entries):
        return {
            "apiVersion": API_VERSION, "kind": "StepJournal",
            "metadata": {
                "name": self._name(k), "namespace": self.namespace,
                "labels": {"agentrun.dev/run": self.run},
                "ownerReferences": [{"apiVersion": API_VERSION, "kind": "AgentRun",
                                     "name": self.run, "uid": self.run_uid}],
            },
            "spec": {"runName": self.run, "runUid": self.run_uid, "step": self.step,
                     "planRevision": self.plan_revision, "chunk": k, "firstSeq": first_seq,
                     "attempt": self.attempt, "sealed": False, "entries": entries},
        }

    @staticmethod
    def _sealable(entries):
        """A full chunk is sealed by the write that fills it when its last entry is final."""
        return len(entries) >= CHUNK_MAX_ENTRIES and entries[-1]["state"] == "Done"

    def _write(self, method, obj, what):
        """One write; the object as stored, or None on a conflict (the caller re-reads)."""
        code, out = self.api.request(method, None if method == "POST" else obj["metadata"]["name"],
                                     obj)
        if code in (200, 201):
            return out
        if code == 409:
            return None
        raise self._refused(what, code, out, after_write=True)

    def _store(self, k, obj):
        if k < len(self._chunks):
            self._chunks[k] = obj
        else:
            self._chunks.append(obj)
        self._entries = [e for c in self._chunks for e in c["spec"].get("entries") or []]

    def _conflict(self):
        """After a 409: read again; a newer attempt raises JournalTakenOver."""
        self._reload()

    def _take_over(self):
        """Writes this attempt's number into the last chunk (or opens the next), so an older
        attempt still running is refused from now on."""
        while not self._owner:
            last = self._chunks[-1] if self._chunks else None
            if last is not None and last["spec"]["attempt"] == self.attempt:
                self._owner = True
            elif last is None or last["spec"].get("sealed"):
                k = len(self._chunks)
                out = self._write("POST", self._chunk(k, len(self._entries), []),
                                  f"opening journal chunk {self._name(k)}")
                if out is None:
                    self._conflict()
                    continue
                self._store(k, out)
                self._owner = True
            else:
                obj = json.loads(json.dumps(last))
                obj["spec"]["attempt"] = self.attempt
                out = self._write("PUT", obj, f"taking journal chunk {obj['metadata']['name']} over")
                if out is None:
                    self._conflict()
                    continue
                self._store(len(self._chunks) - 1, out)
                self._owner = True

    def _put(self, entry):
        """Records entry at its seq: appended past the end, written over the entry there
        otherwise. None once stored; the entry another writer recorded at that position when
        one did first."""
        p = entry["seq"]
        rewrite = p < len(self._entries)
        while True:
            if not rewrite and p < len(self._entries):
                other = self._at(p, entry)
                if other.get("attempt") == self.attempt and other.get("state") == entry["state"]:
                    return None  # this attempt's own write, whose answer was lost
                return other
            out = self._rewrite(entry) if rewrite else self._append(entry)
            if out:
                return None
            self._conflict()

    def _rewrite(self, entry):
        p = entry["seq"]
        k = next(i for i, c in enumerate(self._chunks)
                 if c["spec"]["firstSeq"] <= p < c["spec"]["firstSeq"] + len(c["spec"]["entries"]))
        obj = json.loads(json.dumps(self._chunks[k]))
        if obj["spec"].get("sealed"):
            raise JournalError(f"journal position {p} is in sealed chunk {self._name(k)}")
        entries = obj["spec"]["entries"]
        entries[p - obj["spec"]["firstSeq"]] = entry
        obj["spec"]["attempt"] = self.attempt
        obj["spec"]["sealed"] = self._sealable(entries)
        out = self._write("PUT", obj, f"recording call {p} in {self._name(k)}")
        if out is not None:
            self._store(k, out)
        return out is not None

    def _append(self, entry):
        k = len(self._chunks) - 1
        last = self._chunks[k]
        entries = last["spec"].get("entries") or []
        # An entry that may still change keeps room in its chunk for the largest answer.
        reserve = ENTRY_MAX_BYTES if entry["state"] != "Done" else 0
        room = (sum(entry_bytes(e) for e in entries) + entry_bytes(entry) + reserve
                <= CHUNK_MAX_BYTES)
        sealed = last["spec"].get("sealed")
        if sealed or (entries and (len(entries) >= CHUNK_MAX_ENTRIES or not room)):
            if not sealed:  # full, and its last entry final only now
                obj = json.loads(json.dumps(last))
                obj["spec"]["sealed"] = True
                out = self._write("PUT", obj, f"sealing journal chunk {self._name(k)}")
                if out is None:
                    return False
                self._store(k, out)
            k += 1
            out = self._write("POST", self._chunk(k, entry["seq"], [entry]),
                              f"opening journal chunk {self._name(k)}")
        else:
            obj = json.loads(json.dumps(last))
            obj["spec"]["entries"] = entries + [entry]
            obj["spec"]["attempt"] = self.attempt
            obj["spec"]["sealed"] = self._sealable(obj["spec"]["entries"])
            out = self._write("PUT", obj, f"recording call {entry['seq']} in {self._name(k)}")
        if out is not None:
            self._store(k, out)
        return out is not None

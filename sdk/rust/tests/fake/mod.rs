//! A fake API server for the journal's tests: StepJournal objects over plain
//! HTTP on 127.0.0.1, with the API server's own answers where the journal
//! relies on them — 409 on a stale resourceVersion or an existing name, 403
//! for an update from an attempt older than the chunk's (the chart's
//! `-journals` policy), 422 for a change to a sealed chunk (the CRD's rule) —
//! and a count of the bytes it received.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

const PREFIX: &str = "/apis/agentrun.dev/v1alpha1/namespaces/";

/// One request the server answered.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub name: String,
    pub status: u16,
    pub body: Option<Value>,
}

#[derive(Default)]
struct State {
    objects: BTreeMap<String, Value>,
    version: u64,
    bytes_received: usize,
    seen: Vec<Seen>,
    policy_first: bool,
}

#[derive(Clone)]
pub struct FakeApi {
    url: String,
    state: Arc<Mutex<State>>,
}

impl FakeApi {
    pub fn start() -> FakeApi {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let shared = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let state = shared.clone();
                std::thread::spawn(move || serve(conn, &state));
            }
        });
        FakeApi { url, state }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn object(&self, name: &str) -> Option<Value> {
        self.state.lock().unwrap().objects.get(name).cloned()
    }

    pub fn names(&self) -> Vec<String> {
        self.state.lock().unwrap().objects.keys().cloned().collect()
    }

    pub fn bytes_received(&self) -> usize {
        self.state.lock().unwrap().bytes_received
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    /// Answers an older attempt's update with the policy's 403 even when its
    /// resourceVersion is stale (the real server checks that first: 409).
    pub fn policy_answers_first(&self) {
        self.state.lock().unwrap().policy_first = true;
    }

    /// The operator's settlement of call `seq` in chunk `name` (a status
    /// write: the resourceVersion moves, the spec does not).
    pub fn settle(&self, name: &str, seq: i64, outcome: &str, response: Option<&str>) {
        let mut st = self.state.lock().unwrap();
        st.version += 1;
        let rv = st.version.to_string();
        let obj = st.objects.get_mut(name).expect("chunk to settle");
        // The operator settles the intent of the attempt that wrote it.
        let first = obj["spec"]["firstSeq"].as_i64().unwrap_or(0);
        let attempt = obj["spec"]["entries"][(seq - first) as usize]["attempt"].clone();
        let mut s = json!({"seq": seq, "attempt": attempt, "outcome": outcome,
                           "by": "alice@example.com", "at": "2026-01-01T00:00:00Z"});
        if let Some(r) = response {
            s["response"] = json!(r);
        }
        obj["status"] = json!({"settlements": [s]});
        obj["metadata"]["resourceVersion"] = json!(rv);
    }
}

fn serve(conn: TcpStream, state: &Mutex<State>) {
    conn.set_nodelay(true).unwrap();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut parts = line.split_whitespace();
        let (method, path) = (
            parts.next().unwrap_or("").to_owned(),
            parts.next().unwrap_or("").to_owned(),
        );
        let mut length = 0;
        let mut header_bytes = line.len();
        loop {
            let mut h = String::new();
            reader.read_line(&mut h).unwrap();
            header_bytes += h.len();
            if h == "\r\n" || h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        let (status, answer) = {
            let mut st = state.lock().unwrap();
            st.bytes_received += header_bytes + length;
            let body: Option<Value> =
                (!body.is_empty()).then(|| serde_json::from_slice(&body).unwrap());
            let name = path.rsplit('/').next().unwrap_or("").to_owned();
            let (status, answer) = handle(&mut st, &method, &path, body.clone());
            let name = if method == "POST" {
                body.as_ref()
                    .and_then(|b| b["metadata"]["name"].as_str())
                    .unwrap_or("")
                    .to_owned()
            } else {
                name
            };
            st.seen.push(Seen {
                method: method.clone(),
                name,
                status,
                body,
            });
            (status, answer)
        };
        let text = answer.to_string();
        let head = format!(
            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            text.len()
        );
        if out
            .write_all(head.as_bytes())
            .and_then(|_| out.write_all(text.as_bytes()))
            .is_err()
        {
            return;
        }
    }
}

fn refuse(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "status": "Failure", "reason": reason, "message": message, "code": code}),
    )
}

fn handle(st: &mut State, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let Some(rest) = path.strip_prefix(PREFIX) else {
        return refuse(404, "NotFound", "no such path");
    };
    let segs: Vec<&str> = rest.split('/').collect();
    match (method, segs.as_slice()) {
        ("GET", [_, "stepjournals", name]) => match st.objects.get(*name) {
            Some(o) => (200, o.clone()),
            None => refuse(
                404,
                "NotFound",
                &format!("stepjournals \"{name}\" not found"),
            ),
        },
        ("POST", [ns, "stepjournals"]) => {
            let mut obj = body.unwrap();
            let name = obj["metadata"]["name"].as_str().unwrap().to_owned();
            if st.objects.contains_key(&name) {
                return refuse(
                    409,
                    "AlreadyExists",
                    &format!("stepjournals \"{name}\" already exists"),
                );
            }
            st.version += 1;
            obj["metadata"]["resourceVersion"] = json!(st.version.to_string());
            obj["metadata"]["namespace"] = json!(ns);
            obj["metadata"]["uid"] = json!(format!("uid-{name}"));
            st.objects.insert(name, obj.clone());
            (201, obj)
        }
        ("PUT", [_, "stepjournals", name]) => {
            let mut obj = body.unwrap();
            let Some(old) = st.objects.get(*name).cloned() else {
                return refuse(
                    404,
                    "NotFound",
                    &format!("stepjournals \"{name}\" not found"),
                );
            };
            let stale = obj["metadata"]["resourceVersion"] != old["metadata"]["resourceVersion"];
            let conflict = || {
                refuse(
                    409,
                    "Conflict",
                    "the object has been modified; please apply your changes to the latest version and try again",
                )
            };
            if stale && !st.policy_first {
                return conflict();
            }
            let (was, now) = (
                old["spec"]["attempt"].as_i64().unwrap(),
                obj["spec"]["attempt"].as_i64().unwrap(),
            );
            if now < was {
                return refuse(
                    403,
                    "Forbidden",
                    &format!(
                        "stepjournals \"{name}\" is forbidden: ValidatingAdmissionPolicy 'agentrun-journals' denied request: attempt {was} has taken this journal over; attempt {now} may not write it"
                    ),
                );
            }
            if stale {
                return conflict();
            }
            if old["spec"]["sealed"] == json!(true) && obj["spec"] != old["spec"] {
                return refuse(
                    422,
                    "Invalid",
                    "spec: a sealed journal chunk is final; the next call opens the next chunk",
                );
            }
            st.version += 1;
            obj["metadata"]["resourceVersion"] = json!(st.version.to_string());
            // The main resource does not write status.
            match old.get("status") {
                Some(s) => obj["status"] = s.clone(),
                None => {
                    obj.as_object_mut().unwrap().remove("status");
                }
            }
            st.objects.insert((*name).to_owned(), obj.clone());
            (200, obj)
        }
        _ => refuse(405, "MethodNotAllowed", "not here"),
    }
}

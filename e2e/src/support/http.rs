//! A plain HTTP/1.0 GET for the operator's own endpoints (`/metrics`,
//! `/readyz`, `/healthz`) on loopback: no client library, no TLS, no curl.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// GET `path` from `addr`: the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    http_request(addr, "GET", path, None).await
}

/// One HTTP/1.0 request with an optional JSON body: the status and the body.
pub async fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    json: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let body = json.unwrap_or_default();
    let head = match json {
        Some(_) => format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ),
        None => String::new(),
    };
    s.write_all(
        format!(
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\n{head}Connection: close\r\n\r\n{body}"
        )
        .as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_owned()))
}

/// GET `path` from the local port `port`, which must answer 200 within 5 s.
pub async fn get_ok(port: u16, path: &str) -> String {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    match tokio::time::timeout(std::time::Duration::from_secs(5), http_get(addr, path)).await {
        Ok(Ok((200, body))) => body,
        Ok(Ok((code, body))) => panic!("GET {addr}{path}: HTTP {code}: {body}"),
        Ok(Err(e)) => panic!("GET {addr}{path}: {e}"),
        Err(_) => panic!("GET {addr}{path}: no answer within 5 s"),
    }
}

//! `tandem fault-proxy` relays real sockets to an echo server and does what its admin endpoint
//! says: latency, a bandwidth cap, a blackhole, resets, and refusing bad settings.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Echoes every connection back to itself.
fn echo_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    std::thread::spawn(move || {
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut w = conn.try_clone().expect("clone");
                let _ = std::io::copy(&mut &conn, &mut w);
            });
        }
    });
    addr
}

struct Proxy {
    child: Child,
    addr: String,
    admin: String,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proxy(upstream: &str, flags: &[&str]) -> Proxy {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "fault-proxy",
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            "--upstream",
            upstream,
        ])
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start fault-proxy");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    // "relaying ADDR -> UPSTREAM; admin on http://ADMIN"
    let addr = line
        .strip_prefix("relaying ")
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    let admin = line
        .trim()
        .rsplit_once("http://")
        .map(|(_, a)| a.to_string())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    Proxy { child, addr, admin }
}

/// One HTTP/1.1 request to the admin endpoint: (status code, body).
fn admin(p: &Proxy, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(&p.admin).expect("admin");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let code = out[9..12].parse().expect("status code");
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (code, body)
}

/// Sends `n` bytes and reads them back; the time it took.
fn round_trip(conn: &mut TcpStream, n: usize) -> Duration {
    let data = vec![7u8; n];
    let started = Instant::now();
    let mut writer = conn.try_clone().expect("clone");
    let send = std::thread::spawn(move || writer.write_all(&data).expect("write"));
    let mut back = vec![0u8; n];
    conn.read_exact(&mut back).expect("read back");
    send.join().expect("sender");
    assert!(back.iter().all(|&b| b == 7));
    started.elapsed()
}

#[test]
fn relays_with_latency_and_bandwidth_cap() {
    let p = proxy(
        &echo_server(),
        &["--latency-ms", "100", "--jitter-ms", "20"],
    );
    let mut conn = TcpStream::connect(&p.addr).expect("connect");
    // Both directions are delayed by 100 ± 20 ms.
    let rtt = round_trip(&mut conn, 1);
    assert!(rtt >= Duration::from_millis(160), "{rtt:?}");

    let (code, body) = admin(&p, "PUT", "/faults", r#"{"bandwidth_bps":200000}"#);
    assert_eq!(code, 200, "{body}");
    let (_, shown) = admin(&p, "GET", "/faults", "");
    assert!(shown.contains(r#""bandwidth_bps":200000"#), "{shown}");
    assert!(
        shown.contains(r#""latency_ms":0"#),
        "PUT sets every knob: {shown}"
    );
    // 100 kB at 200 kB/s takes at least half a second each way (the two overlap).
    let t = round_trip(&mut conn, 100_000);
    assert!(t >= Duration::from_millis(450), "{t:?}");
}

#[test]
fn blackholes_and_resets_connections() {
    let p = proxy(&echo_server(), &[]);
    let mut conn = TcpStream::connect(&p.addr).expect("connect");
    round_trip(&mut conn, 10);

    assert_eq!(admin(&p, "PUT", "/faults", r#"{"blackhole":true}"#).0, 200);
    conn.write_all(b"lost").expect("write");
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut buf = [0u8; 4];
    let e = conn.read(&mut buf).expect_err("nothing comes back");
    assert!(
        matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{e}"
    );

    // Healed: the connection is open and carries bytes again.
    assert_eq!(admin(&p, "PUT", "/faults", "{}").0, 200);
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    round_trip(&mut conn, 10);

    let (code, body) = admin(&p, "POST", "/reset", "");
    assert_eq!(code, 200);
    assert!(body.contains("reset 1 connections"), "{body}");
    let e = conn.read(&mut buf).expect_err("reset");
    assert_eq!(e.kind(), ErrorKind::ConnectionReset, "{e}");
}

#[test]
fn bad_settings_are_refused() {
    let p = proxy(&echo_server(), &[]);
    let (code, body) = admin(&p, "PUT", "/faults", r#"{"latency_ms":600000}"#);
    assert_eq!(code, 400);
    assert!(body.contains("at most 60000"), "{body}");
    let (code, body) = admin(&p, "PUT", "/faults", r#"{"latency":5}"#);
    assert!((400..500).contains(&code), "{code} {body}");
    assert!(body.contains("unknown field"), "{body}");

    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["fault-proxy", "--upstream", "no port here"])
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("expected host:port"), "{err}");
}

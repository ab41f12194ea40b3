//! Several routers as separate processes over the same workers, each the other's peer, over
//! mutual TLS (certificates from `tandem certs init`): a router killed (SIGKILL) in the middle
//! of a stream loses nothing its peer can finish, as the stream's client retries on the peer
//! with the same request id; and a retry that reaches the peer while the first router still
//! runs the stream attaches to it there. Runs on SmolLM2, whose 300 tokens take long enough
//! (seconds) to be caught running.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tandem_proto::v1 as pb;

/// A `tandem` process, killed when dropped.
struct Process {
    child: Child,
    /// Its gRPC address, as it printed it.
    addr: String,
}

impl Process {
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(args)
            .env_remove("TANDEM_MODEL")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tandem");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        // The gRPC line comes last (after a router's `http` and `peer` lines).
        let addr = loop {
            let line = lines
                .next()
                .expect("exited before listening")
                .expect("line");
            if let Some(addr) = line.strip_prefix("listening on ") {
                break addr.to_string();
            }
        };
        std::thread::spawn(move || lines.for_each(drop));
        Self { child, addr }
    }

    fn kill(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("SIGKILL");
        self.child.wait().expect("wait");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn request(id: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        prompt: Some("the river runs".into()),
        sampling: Some(pb::SamplingParams {
            max_tokens: 300,
            min_tokens: 300,
            temperature: 0.9,
            seed: 11,
            ..Default::default()
        }),
        ..Default::default()
    }
}

type Client = pb::generation_client::GenerationClient<tonic::transport::Channel>;

async fn client(addr: &str) -> Client {
    let started = Instant::now();
    loop {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("uri")
            .connect()
            .await;
        if let Ok(channel) = channel {
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
            let ask = tonic_health::pb::HealthCheckRequest {
                service: "tandem.v1.Generation".into(),
            };
            let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
            if health
                .check(ask)
                .await
                .is_ok_and(|r| r.into_inner().status == serving)
            {
                return Client::new(channel);
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{addr} never served"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends request `id` and reads its first frame: the rest of the stream, and that frame.
async fn begin(
    client: &mut Client,
    id: &str,
) -> (tonic::Streaming<pb::GenerateResponse>, pb::GenerateResponse) {
    let mut frames = client
        .generate(request(id))
        .await
        .expect("a stream")
        .into_inner();
    let first = frames
        .message()
        .await
        .expect("a frame")
        .expect("a first frame");
    (frames, first)
}

/// Reads a stream to its end: its tokens, or the status it failed with after `frames` frames.
async fn read(
    mut frames: tonic::Streaming<pb::GenerateResponse>,
) -> Result<Vec<u32>, (usize, tonic::Status)> {
    let (mut tokens, mut n) = (Vec::new(), 0);
    loop {
        match frames.message().await {
            Ok(Some(f)) => {
                n += 1;
                tokens.extend(f.token_ids);
                if f.finish_reason != pb::FinishReason::Unspecified as i32 {
                    return Ok(tokens);
                }
            }
            Ok(None) => return Err((n, tonic::Status::data_loss("no final frame"))),
            Err(status) => return Err((n, status)),
        }
    }
}

/// The value of a sample line of router `addr`'s metrics.
async fn sample(addr: &str, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.ok()?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: tandem\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await.ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[test]
fn a_killed_routers_streams_finish_on_its_peer() {
    let certs = std::env::temp_dir().join(format!("tandem-routers-certs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&certs);
    let made = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["certs", "init"])
        .arg(&certs)
        .output()
        .expect("certs init");
    assert!(made.status.success(), "{made:?}");
    let tls = certs.to_str().expect("utf-8 path");
    let worker = |role: &str| {
        Process::start(&[
            role,
            "--model",
            "smollm2",
            "--listen",
            "127.0.0.1:0",
            "--threads",
            "1",
            "--tls-dir",
            tls,
        ])
    };
    let (prefill, decode) = (worker("prefill"), worker("decode"));
    let peers = [free_port(), free_port()];
    let peer_list = format!("127.0.0.1:{},127.0.0.1:{}", peers[0], peers[1]);
    let router = |peer: u16| {
        Process::start(&[
            "router",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "off",
            "--prefill",
            &prefill.addr,
            "--decode",
            &decode.addr,
            "--tls-dir",
            tls,
            "--peer-listen",
            &format!("127.0.0.1:{peer}"),
            "--peers",
            &peer_list,
            "--load-poll-ms",
            "50",
        ])
    };
    let (mut a, b) = (router(peers[0]), router(peers[1]));
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let (mut to_a, mut to_b) = (client(&a.addr).await, client(&b.addr).await);
        // Each hears the other over mutual TLS.
        let started = Instant::now();
        for (router, peer) in [(&a.addr, peers[1]), (&b.addr, peers[0])] {
            let name = format!("tandem_router_peer_staleness_seconds{{peer=\"127.0.0.1:{peer}\"}}");
            while !sample(router, &name).await.is_some_and(|s| s < 1.0) {
                assert!(
                    started.elapsed() < Duration::from_secs(15),
                    "{router} never heard {peer}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let reference = read(
            to_b.generate(request("reference"))
                .await
                .expect("b")
                .into_inner(),
        )
        .await
        .expect("an uninterrupted run");
        assert_eq!(reference.len(), 300);

        // Running on a, retried on b once b has heard of it (a few of its 50 ms asks): b
        // attaches to a's stream.
        let (on_a, first) = begin(&mut to_a, "twice").await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let on_b = to_b
            .generate(request("twice"))
            .await
            .expect("b")
            .into_inner();
        let (rest_a, on_b) = tokio::join!(read(on_a), read(on_b));
        let mut on_a = first.token_ids;
        on_a.extend(rest_a.expect("a's stream"));
        assert_eq!(on_a, reference);
        assert_eq!(on_b.expect("b's stream"), reference);
        let attached = sample(&b.addr, "tandem_router_peer_attaches_total").await;
        assert_eq!(attached, Some(1.0), "b attached to a's stream");

        // Killed mid-stream: the client's retry on b starts it again there (a's last word still
        // lists it; the attach finds a gone), and it says the same.
        let (on_a, first) = begin(&mut to_a, "killed").await;
        assert_eq!(first.finish_reason, pb::FinishReason::Unspecified as i32);
        a.kill();
        let (delivered, status) = read(on_a).await.expect_err("a died mid-stream");
        assert!(delivered < 299, "{delivered} more frames came: {status}");
        let retried = read(
            to_b.generate(request("killed"))
                .await
                .expect("b")
                .into_inner(),
        )
        .await
        .expect("the retry on b");
        assert_eq!(
            retried, reference,
            "the same tokens as the uninterrupted run"
        );
    });
    let _ = std::fs::remove_dir_all(&certs);
}

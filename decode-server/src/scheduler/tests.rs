//! The scheduler with the tiny model: a batch stream paused for an interactive one, its KV
//! pinned or on the disk tier, resumes where it stood, with the tokens of an uninterrupted run.

use std::path::PathBuf;

use tandem_engine::{
    EngineConfig, GenerateParams, Model, ModelSource, SamplingParams, SpillConfig,
};

use tandem_proto::policy::Class;

use super::*;

const INTERACTIVE: Class = Class::Interactive;
const STANDARD: Class = Class::Standard;
const BATCH: Class = Class::Batch;

struct Bench {
    handle: SchedulerHandle,
    shared: Arc<Shared>,
    model: Arc<Model>,
    next: u64,
    _dir: Option<Dir>,
}

/// A directory removed when dropped.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bench(pinned_bytes: u64, disk: bool) -> Bench {
    let model = ModelSource::TINY.load().expect("tiny model");
    let dir = disk.then(|| {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("tandem-park-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        Dir(path)
    });
    let config = EngineConfig {
        threads: 1,
        prefix_cache_bytes: usize::MAX,
        spill: dir.as_ref().map(|d| SpillConfig {
            dir: d.0.clone(),
            max_bytes: 1 << 30,
        }),
        ..EngineConfig::default()
    };
    let engine = Engine::new(model.clone(), config).expect("engine");
    let mut registry = prometheus_client::registry::Registry::default();
    let shared = Arc::new(Shared {
        metrics: DecodeMetrics::register(&mut registry),
        hub: Arc::default(),
        throughput: Default::default(),
        handoffs: Arc::default(),
    });
    let slots = Slots {
        max_slots: 1,
        handoff_bytes: 0,
        pinned_bytes,
        batch_beside: 1,
    };
    let (handle, _thread) = SchedulerHandle::spawn(engine, shared.clone(), slots).expect("spawn");
    Bench {
        handle,
        shared,
        model,
        next: 0,
        _dir: dir,
    }
}

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| 3 + (i * 7 + salt * 31) % 200).collect()
}

impl Bench {
    /// Starts a seeded stream of `class` computed here; its events.
    async fn start(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
        class: Class,
    ) -> tmpsc::Receiver<Event> {
        self.start_with(prompt, max_tokens, class, |_, _| Input::Local)
            .await
    }

    /// Starts a seeded stream whose prompt's KV is pushed, computed on an engine of its own as
    /// a prefill node would; its events.
    async fn start_pushed(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> tmpsc::Receiver<Event> {
        let model = self.model.clone();
        self.start_with(prompt, max_tokens, BATCH, |prompt, stream| {
            let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
            let seq = engine.new_sequence();
            let logits = engine.prefill(seq, prompt).expect("prefill");
            Input::Kv {
                kv: engine.export_kv(seq, 0..prompt.len()).expect("export"),
                first_token: stream.sample(&model.tokenizer, &logits, prompt.len()),
                first_logprobs: None,
            }
        })
        .await
    }

    async fn start_with(
        &mut self,
        prompt: Vec<u32>,
        max_tokens: usize,
        class: Class,
        input: impl FnOnce(&[u32], &mut Stream) -> Input,
    ) -> tmpsc::Receiver<Event> {
        let params = GenerateParams {
            sampling: SamplingParams {
                temperature: 0.9,
                seed: 11,
                ..SamplingParams::default()
            },
            max_tokens,
            min_tokens: max_tokens,
            ..GenerateParams::default()
        };
        let mut stream = Stream::new(params, &self.model, &prompt).expect("stream");
        let input = input(&prompt, &mut stream);
        self.next += 1;
        let ticket = Ticket(self.next);
        let hashes =
            tandem_proto::block_hash::prompt_hashes(&self.model.fingerprint.0, "", &prompt);
        self.handle
            .open(ticket, hashes, None)
            .await
            .expect("opened");
        let (events, rx) = tmpsc::channel(max_tokens + 3);
        let joining = Joining {
            ticket,
            prompt,
            cache_salt: String::new(),
            class,
            stream,
            events,
        };
        assert!(self.handle.start(Start { input, joining }));
        rx
    }
}

/// Reads tokens until `n` have come (or the stream ends); `true` once it has ended.
async fn read(rx: &mut tmpsc::Receiver<Event>, tokens: &mut Vec<u32>, n: usize) -> bool {
    while tokens.len() < n {
        match rx.recv().await.expect("an event") {
            Event::Prefilled { .. } => {}
            Event::Tokens { emissions, .. } => {
                for e in emissions {
                    tokens.extend(e.token);
                    if e.finished.is_some() {
                        return true;
                    }
                }
            }
            Event::Failed(e) => panic!("the stream failed: {e}"),
        }
    }
    false
}

/// Takes the tokens already sent.
fn drain(rx: &mut tmpsc::Receiver<Event>, tokens: &mut Vec<u32>) {
    while let Ok(Event::Tokens { emissions, .. }) = rx.try_recv() {
        tokens.extend(emissions.iter().filter_map(|e| e.token));
    }
}

async fn run_alone(b: &mut Bench, prompt: Vec<u32>, max_tokens: usize) -> Vec<u32> {
    let mut rx = b.start(prompt, max_tokens, BATCH).await;
    let mut tokens = Vec::new();
    assert!(read(&mut rx, &mut tokens, usize::MAX).await);
    tokens
}

/// A batch stream, 10 tokens in, is paused for an interactive one (one slot), which runs to its
/// end before the batch stream goes on; the batch stream's tokens are its uninterrupted run's.
async fn paused_and_resumed(pinned_bytes: u64, disk: bool) -> Arc<Shared> {
    // The uninterrupted run on a node of its own: on this one its KV would stay in the session
    // cache, and the paused stream's blocks, which it shares, in the pool.
    let alone = run_alone(&mut bench(u64::MAX, false), prompt(40, 1), 60).await;
    assert_eq!(alone.len(), 60);
    let mut b = bench(pinned_bytes, disk);

    let mut batch = b.start(prompt(40, 1), 60, BATCH).await;
    let mut tokens = Vec::new();
    assert!(!read(&mut batch, &mut tokens, 10).await);
    let mut interactive = b.start(prompt(24, 2), 20, INTERACTIVE).await;
    // Its first token comes as it joins, once its prompt is computed (the batch stream goes on
    // meanwhile); from then on it has the slot, and the batch stream waits.
    let mut other = Vec::new();
    assert!(!read(&mut interactive, &mut other, 1).await);
    drain(&mut batch, &mut tokens);
    assert!(read(&mut interactive, &mut other, usize::MAX).await);
    assert_eq!(other.len(), 20);
    // At most a step of the resumed stream's may have come since the interactive one ended.
    let mut during = Vec::new();
    drain(&mut batch, &mut during);
    assert!(
        during.len() < 8,
        "{} batch tokens during the pause",
        during.len()
    );
    tokens.extend(during);
    assert!(read(&mut batch, &mut tokens, usize::MAX).await);
    assert_eq!(
        tokens, alone,
        "the resumed stream differs from its uninterrupted run"
    );
    let m = &b.shared.metrics;
    assert_eq!(m.preemptions.get(), 1);
    assert_eq!(m.recomputed_tokens.get(), 0);
    assert_eq!(m.parked_streams.get(), 0);
    assert!(m.parked_bytes.get() > 0);
    b.shared.clone()
}

#[tokio::test]
async fn a_stream_paused_with_its_kv_pinned_resumes_exactly() {
    let shared = paused_and_resumed(u64::MAX, false).await;
    assert_eq!(shared.metrics.parked_disk_bytes.get(), 0);
}

#[tokio::test]
async fn a_stream_paused_with_its_kv_on_disk_resumes_exactly() {
    let shared = paused_and_resumed(0, true).await;
    assert!(shared.metrics.parked_disk_bytes.get() > 0);
}

/// A ready sequence at or below the running one's class pauses nothing; when the slot frees,
/// the higher class of those ready takes it, whatever their arrival.
#[tokio::test]
async fn nothing_is_paused_for_a_class_at_or_below_the_running_one() {
    let mut b = bench(u64::MAX, false);
    let mut first = b.start(prompt(16, 1), 900, INTERACTIVE).await;
    let mut tokens = Vec::new();
    assert!(!read(&mut first, &mut tokens, 5).await);
    let mut second = b.start(prompt(24, 2), 10, STANDARD).await;
    let mut second_tokens = Vec::new();
    assert!(!read(&mut second, &mut second_tokens, 1).await);
    let mut third = b.start(prompt(24, 3), 10, INTERACTIVE).await;
    assert!(!read(&mut third, &mut Vec::new(), 1).await);
    // Both are ready (their first tokens came as they joined) while the first still runs.
    drain(&mut first, &mut tokens);
    assert!(
        tokens.len() < 900,
        "the first stream ended before the others were ready"
    );
    assert!(read(&mut first, &mut tokens, usize::MAX).await);
    assert!(read(&mut third, &mut Vec::new(), usize::MAX).await);
    // The interactive one took the slot first: the standard one has at most its first token
    // and a step or two that followed the interactive one's end.
    drain(&mut second, &mut second_tokens);
    assert!(second_tokens.len() <= 8, "{second_tokens:?}");
    assert!(read(&mut second, &mut second_tokens, usize::MAX).await);
    assert_eq!(b.shared.metrics.preemptions.get(), 0);
}

/// A pushed KV that lands while a stream decodes is copied between its steps (a share of a
/// step per round), and the stream it starts gives the tokens it gives when imported at once on
/// an idle node.
#[tokio::test]
async fn a_pushed_kv_imported_between_steps_gives_the_tokens_of_one_import() {
    let at_once = {
        let mut b = bench(u64::MAX, false);
        let mut rx = b.start_pushed(prompt(40, 4), 30).await;
        let mut tokens = Vec::new();
        assert!(read(&mut rx, &mut tokens, usize::MAX).await);
        assert_eq!(b.shared.metrics.kv_import_seconds.count(), 1, "one round");
        tokens
    };
    let mut b = bench(u64::MAX, false);
    let mut running = b.start(prompt(16, 5), 900, BATCH).await;
    let mut before = Vec::new();
    assert!(!read(&mut running, &mut before, 20).await);
    let mut pushed = b.start_pushed(prompt(40, 4), 30).await;
    let mut tokens = Vec::new();
    // Its first token comes as it joins, with its KV in the pool; the slot is the running
    // stream's until it ends.
    assert!(!read(&mut pushed, &mut tokens, 1).await);
    drain(&mut running, &mut before);
    assert!(before.len() < 900, "the running stream ended first");
    assert!(read(&mut pushed, &mut tokens, usize::MAX).await);
    assert_eq!(tokens, at_once);
    assert!(b.shared.metrics.kv_import_seconds.count() >= 1);
}

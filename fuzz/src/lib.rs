//! What the fuzz targets share: the default model's tokenizer and the worker info a router
//! learns it from, loaded once per fuzzing process. The real model (`tandem model fetch`) is
//! used rather than the tiny one so that its BPE merges and chat template are what is fuzzed;
//! Gemma 3's (`tandem model fetch gemma-3-270m`) is the SentencePiece tokenizer fuzzed.

use std::sync::{Arc, OnceLock};

use tandem_engine::Model;
use tandem_proto::v1 as pb;
use tandem_tokenizer::Tokenizer;

fn load(name: &str) -> Arc<Model> {
    let dir = tandem_engine::model_dir_from_env();
    tandem_engine::ModelSource::parse(name, &dir)
        .load()
        .unwrap_or_else(|e| panic!("the fuzz targets need {name} (tandem model fetch {name}): {e}"))
}

fn model() -> &'static Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL.get_or_init(|| load("smollm2"))
}

/// Gemma 3's SentencePiece tokenizer.
pub fn sentence_piece_tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        Tokenizer::new(load("gemma-3-270m").tokenizer.spec()).expect("Gemma's tokenizer")
    })
}

/// The model's tokenizer, with its chat template.
pub fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        Tokenizer::new(model().tokenizer.spec()).expect("the model's tokenizer")
    })
}

/// What a decode node tells the router about itself.
pub fn worker_info() -> pb::InfoResponse {
    tandem_worker::worker_info(
        model(),
        model().config.kv_layout(tandem_engine::KvDtype::F16),
        "decode",
    )
}

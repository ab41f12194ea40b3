//! What the fuzz targets share: the default model's tokenizer and the worker info a router
//! learns it from, loaded once per fuzzing process. The real model (`tandem model fetch`) is
//! used rather than the tiny one so that its BPE merges and chat template are what is fuzzed.

use std::sync::{Arc, OnceLock};

use tandem_engine::Model;
use tandem_proto::v1 as pb;
use tandem_tokenizer::Tokenizer;

fn model() -> &'static Arc<Model> {
    static MODEL: OnceLock<Arc<Model>> = OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = tandem_engine::model_dir_from_env();
        tandem_engine::ModelSource::parse("default", &dir)
            .load()
            .unwrap_or_else(|e| {
                panic!("the fuzz targets need the default model (run `tandem model fetch`): {e}")
            })
    })
}

/// The model's tokenizer, with its chat template.
pub fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        Tokenizer::new(model().tokenizer_spec.clone()).expect("the model's tokenizer")
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

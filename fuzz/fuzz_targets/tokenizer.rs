//! The tokenizers (byte-level BPE and SentencePiece) on arbitrary bytes: encode the text
//! (invalid UTF-8 replaced; special tokens parsed, as a raw prompt's are), every id within the
//! vocabulary, and decode the ids back; then decode the input read as token ids, in and out of
//! the vocabulary.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    check(tandem_fuzz::tokenizer(), data);
    check(tandem_fuzz::sentence_piece_tokenizer(), data);
});

fn check(tokenizer: &Tokenizer, data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(ids) = tokenizer.encode(&text) {
        let vocab = tokenizer.vocab_size();
        assert!(ids.iter().all(|&t| (t as usize) < vocab));
        let _ = tokenizer.decode(&ids);
    }
    let ids: Vec<u32> = data
        .chunks_exact(4)
        .map(|c| {
            u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % (tokenizer.vocab_size() as u32 + 16)
        })
        .collect();
    let _ = tokenizer.decode(&ids);
}

//! The chat template renderer on hostile messages: the input is split at 0xFF bytes into
//! role, content, role, content, ... (invalid UTF-8 replaced), rendered with the model's
//! template, and the result tokenized. Unknown roles must be refused, never rendered.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_tokenizer::ChatMessage;

fuzz_target!(|data: &[u8]| {
    let parts: Vec<String> = data
        .split(|&b| b == 0xFF)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    let messages: Vec<ChatMessage> = parts
        .chunks(2)
        .map(|pair| ChatMessage::new(pair[0].clone(), pair.get(1).cloned().unwrap_or_default()))
        .collect();
    let tokenizer = tandem_fuzz::tokenizer();
    if let Ok(text) = tokenizer.apply_chat_template(&messages, &[]) {
        assert!(
            messages
                .iter()
                .all(|m| ["system", "user", "assistant", "tool"].contains(&m.role.as_str())),
            "a message with another role was rendered"
        );
        let _ = tokenizer.encode(&text);
    }
});

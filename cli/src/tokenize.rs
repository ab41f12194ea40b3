//! `tandem tokenize`: a text's token ids, with the model's own tokenizer.

use clap::Args;
use serde::Serialize;
use tandem_client::ModelArgs;

#[derive(Args, Debug)]
pub(crate) struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to tokenize (special tokens such as `<|im_start|>` are parsed).
    #[arg(long)]
    text: String,
    /// Print `{"token_ids":[...]}` instead of one id per line.
    #[arg(long)]
    json: bool,
}

pub(crate) fn tokenize(args: &TokenizeArgs) -> anyhow::Result<()> {
    let model = args.model.source().load()?;
    let ids = model.tokenizer.encode(&args.text)?;
    if args.json {
        #[derive(Serialize)]
        struct Out {
            token_ids: Vec<u32>,
        }
        println!("{}", serde_json::to_string(&Out { token_ids: ids })?);
    } else {
        for id in ids {
            println!("{id}");
        }
    }
    Ok(())
}

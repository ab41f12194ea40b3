//! `tandem certs init DIR`: a development CA and a certificate per role for mutual TLS between
//! nodes (`tandem_net::tls::write_dev_certs`).

use std::path::PathBuf;

use clap::Args;

#[derive(Args, Debug)]
pub(crate) struct InitArgs {
    /// Where to write ca.pem, ca.key, and ROLE.pem and ROLE.key for each role.
    dir: PathBuf,
    /// More names for every node certificate (DNS names or IP addresses; repeatable).
    #[arg(long = "name")]
    names: Vec<String>,
    /// How long the certificates are valid, in days.
    #[arg(long, default_value_t = 365)]
    days: u32,
    /// Replace files that exist (otherwise an existing ca.pem is an error).
    #[arg(long)]
    force: bool,
}

pub(crate) fn init(args: &InitArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.force || !args.dir.join("ca.pem").exists(),
        "{} already holds a CA (use --force to replace it)",
        args.dir.display()
    );
    let written = tandem_net::tls::write_dev_certs(&args.dir, &args.names, args.days)?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}

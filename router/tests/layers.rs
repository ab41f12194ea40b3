//! The router's layout, checked from its sources: modules sit in layers (the API front,
//! dispatch, the cluster view, over shared modules), every `crate::` path in a module's code
//! names a module of its own layer or one below, the modules of a layer use each other without
//! a cycle, and no file is over 600 lines.
//!
//! `cargo test -p tandem-router --test layers -- --nocapture` prints the module graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, from the top: a module's layer is that of the first prefix it starts with.
const LAYERS: [(&str, &[&str]); 5] = [
    ("the crate root", &["", "simulation", "fuzzing"]),
    ("api", &["api"]),
    ("dispatch", &["dispatch"]),
    ("cluster", &["cluster"]),
    ("shared", &["auth", "config", "error", "ids", "metrics"]),
];

const MAX_LINES: usize = 600;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every source file, by its module path (`dispatch::admit`; the crate root is "").
fn modules() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src()).expect("under src");
            let mut parts: Vec<String> = relative
                .with_extension("")
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            out.insert(parts.join("::"), text);
        }
    }
    out
}

fn layer(module: &str) -> usize {
    let top = module.split("::").next().unwrap_or("");
    LAYERS
        .iter()
        .position(|(_, prefixes)| prefixes.contains(&top))
        .unwrap_or_else(|| panic!("module {module} is in no layer: add it to LAYERS"))
}

/// The modules a module's code (its comments and its tests aside) names by `crate::` path, as
/// the longest prefix of the path that is a module.
fn uses(text: &str, known: &BTreeSet<&str>) -> BTreeSet<String> {
    let code = text
        .split("\n#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or(text);
    let mut out = BTreeSet::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or("");
        for (i, _) in line.match_indices("crate::") {
            let rest = &line[i + "crate::".len()..];
            // `crate::a::b::{c, d}` and `crate::a::b::c` alike: the path's segments up to the
            // first that is not a module.
            let path: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let module = (1..=segments.len())
                .rev()
                .map(|n| segments[..n].join("::"))
                .find(|m| known.contains(m.as_str()))
                .unwrap_or_default();
            out.insert(module);
        }
    }
    out
}

#[test]
fn imports_run_down_the_layers_without_cycles() {
    let modules = modules();
    let known: BTreeSet<&str> = modules.keys().map(String::as_str).collect();
    let mut graph: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for (module, text) in &modules {
        let mut edges = uses(text, &known);
        edges.remove(module);
        for used in &edges {
            // A module may use its own descendants (a folder's `mod.rs`, its children).
            let own = !module.is_empty() && used.starts_with(&format!("{module}::"));
            if layer(used) < layer(module) && !own && !module.is_empty() {
                wrong.push(format!(
                    "{module} ({}) uses {used} ({}), a layer up",
                    LAYERS[layer(module)].0,
                    LAYERS[layer(used)].0
                ));
            }
        }
        graph.insert(module, edges);
    }
    for (module, edges) in &graph {
        println!(
            "{:<24} -> {}",
            if module.is_empty() { "(root)" } else { module },
            {
                let e: Vec<&str> = edges.iter().map(String::as_str).collect();
                e.join(", ")
            }
        );
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));

    // Within each layer, no cycle: repeatedly take out the modules that use no module left.
    let mut left: BTreeMap<&str, BTreeSet<&str>> = graph
        .iter()
        .map(|(m, edges)| {
            let same: BTreeSet<&str> = edges
                .iter()
                .map(String::as_str)
                .filter(|u| layer(u) == layer(m) && !u.starts_with(&format!("{m}::")))
                .filter(|u| !m.is_empty() && !u.is_empty())
                .collect();
            (*m, same)
        })
        .collect();
    while !left.is_empty() {
        let free: Vec<&str> = left
            .iter()
            .filter(|(_, uses)| uses.iter().all(|u| !left.contains_key(u)))
            .map(|(m, _)| *m)
            .collect();
        assert!(!free.is_empty(), "a cycle among: {left:?}");
        for m in free {
            left.remove(m);
        }
    }
}

#[test]
fn no_file_is_over_600_lines() {
    let long: Vec<String> = modules()
        .into_iter()
        .filter(|(_, text)| text.lines().count() > MAX_LINES)
        .map(|(m, text)| format!("{m}: {} lines", text.lines().count()))
        .collect();
    assert!(long.is_empty(), "split by concern: {long:?}");
}

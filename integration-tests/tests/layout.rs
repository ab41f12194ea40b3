//! The workspace's layout, checked from its sources: in every crate, the modules that a module's
//! shipped code names (by `crate::`, `super::`, `self::` or a child module's path, in code and in
//! macro bodies alike) form no cycle; no shipped file is over [`MAX_FILE_LINES`] lines and no
//! shipped function over [`MAX_FN_LINES`]. Test code (`#[cfg(test)]` items and the modules they
//! declare) is not shipped, and neither is this crate. The router's modules, besides, sit in
//! layers that only use their own and those below.
//!
//! `cargo test -p tandem-integration-tests --test layout -- --nocapture` prints each crate's
//! module graph.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

const MAX_FILE_LINES: usize = 600;
const MAX_FN_LINES: usize = 150;

/// Crates that ship nothing: their files and functions are not bounded (their modules still
/// may not form a cycle).
const NOT_SHIPPED: [&str; 2] = ["integration-tests", "fuzz"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace holds this crate")
        .to_path_buf()
}

/// The workspace's crates with sources: (folder name, `src` path).
fn crates() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(workspace())
        .expect("read the workspace")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.join("Cargo.toml").is_file() && p.join("src").is_dir())
        .map(|p| {
            let name = p
                .file_name()
                .expect("a name")
                .to_string_lossy()
                .into_owned();
            (name, p.join("src"))
        })
        .collect();
    out.sort();
    out
}

/// One source file of a crate.
struct Module {
    path: PathBuf,
    text: String,
    ast: syn::File,
}

/// Every source file of a crate, by module path (`scheduler::slots`; the crate root is "").
fn modules(src: &Path) -> BTreeMap<String, Module> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
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
            let relative = path.strip_prefix(src).expect("under src");
            let mut parts: Vec<String> = relative
                .with_extension("")
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            if matches!(
                parts.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                parts.pop();
            }
            let text = std::fs::read_to_string(&path).expect("read a source file");
            let ast = syn::parse_file(&text)
                .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
            out.insert(parts.join("::"), Module { path, text, ast });
        }
    }
    out
}

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

/// What one file's shipped code names and declares.
#[derive(Default)]
struct Scan {
    /// Paths as written, each a list of segments.
    paths: Vec<Vec<String>>,
    /// Child modules declared `#[cfg(test)] mod x;` (their files are test code).
    test_children: Vec<String>,
    /// Functions with a body: (name, first line, lines).
    functions: Vec<(String, usize, usize)>,
}

impl Scan {
    fn function(&mut self, name: &syn::Ident, span: proc_macro2::Span) {
        let (start, end) = (span.start().line, span.end().line);
        self.functions
            .push((name.to_string(), start, end + 1 - start));
    }

    /// Every `a::b::c` in a macro's tokens, whatever the macro makes of them.
    fn tokens(&mut self, tokens: TokenStream) {
        let mut path: Vec<String> = Vec::new();
        let mut colons = 0;
        for tree in tokens {
            match tree {
                TokenTree::Group(g) => {
                    self.flush(&mut path);
                    self.tokens(g.stream());
                }
                TokenTree::Ident(i) => {
                    if colons != 2 {
                        self.flush(&mut path);
                    }
                    path.push(i.to_string());
                    colons = 0;
                }
                TokenTree::Punct(p) if p.as_char() == ':' && !path.is_empty() => colons += 1,
                TokenTree::Punct(_) | TokenTree::Literal(_) => {
                    self.flush(&mut path);
                    colons = 0;
                }
            }
        }
        self.flush(&mut path);
    }

    fn flush(&mut self, path: &mut Vec<String>) {
        if path.len() > 1 {
            self.paths.push(std::mem::take(path));
        }
        path.clear();
    }
}

fn use_paths(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    match tree {
        syn::UseTree::Path(p) => {
            prefix.push(p.ident.to_string());
            use_paths(&p.tree, prefix, out);
            prefix.pop();
        }
        syn::UseTree::Name(n) => out.push([&prefix[..], &[n.ident.to_string()]].concat()),
        syn::UseTree::Rename(r) => out.push([&prefix[..], &[r.ident.to_string()]].concat()),
        syn::UseTree::Glob(_) => out.push(prefix.clone()),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                use_paths(t, prefix, out);
            }
        }
    }
}

impl<'ast> Visit<'ast> for Scan {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Fn(i) => &i.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Mod(i) => &i.attrs,
            syn::Item::Use(i) => &i.attrs,
            syn::Item::Const(i) => &i.attrs,
            syn::Item::Static(i) => &i.attrs,
            syn::Item::Struct(i) => &i.attrs,
            syn::Item::Enum(i) => &i.attrs,
            syn::Item::Trait(i) => &i.attrs,
            syn::Item::Macro(i) => &i.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if is_test_only(attrs) {
            if let syn::Item::Mod(m) = item
                && m.content.is_none()
            {
                self.test_children.push(m.ident.to_string());
            }
            return;
        }
        syn::visit::visit_item(self, item);
    }

    fn visit_impl_item(&mut self, item: &'ast syn::ImplItem) {
        if let syn::ImplItem::Fn(f) = item
            && is_test_only(&f.attrs)
        {
            return;
        }
        syn::visit::visit_impl_item(self, item);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        use_paths(&item.tree, &mut Vec::new(), &mut self.paths);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.segments.len() > 1 {
            self.paths
                .push(path.segments.iter().map(|s| s.ident.to_string()).collect());
        }
        syn::visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.tokens(mac.tokens.clone());
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        use syn::spanned::Spanned;
        self.function(&f.sig.ident, f.span());
        syn::visit::visit_item_fn(self, f);
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        use syn::spanned::Spanned;
        self.function(&f.sig.ident, f.span());
        syn::visit::visit_impl_item_fn(self, f);
    }

    fn visit_trait_item_fn(&mut self, f: &'ast syn::TraitItemFn) {
        use syn::spanned::Spanned;
        if f.default.is_some() {
            self.function(&f.sig.ident, f.span());
        }
        syn::visit::visit_trait_item_fn(self, f);
    }
}

/// The module a path written in `module` names, as the longest prefix of it that is a module
/// of the crate; `None` for other crates' paths and for names in scope.
fn resolve(module: &str, path: &[String], known: &BTreeMap<String, Module>) -> Option<String> {
    let mut at: Vec<&str> = if module.is_empty() {
        Vec::new()
    } else {
        module.split("::").collect()
    };
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            at.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().is_some_and(|s| s == "super") {
                at.pop();
                rest = &rest[1..];
            }
        }
        Some(first) => {
            let child = [&at[..], &[first]].concat().join("::");
            if !known.contains_key(&child) {
                return None;
            }
        }
        None => return None,
    }
    let mut best = at.join("::");
    let mut walk = at;
    for segment in rest {
        walk.push(segment);
        let candidate = walk.join("::");
        if known.contains_key(&candidate) {
            best = candidate;
        } else {
            break;
        }
    }
    Some(best)
}

/// A module's edges to other modules: a module's own descendants (which it declares) and the
/// crate root (which declares every top module) are not dependencies.
fn edges(module: &str, scan: &Scan, known: &BTreeMap<String, Module>) -> BTreeSet<String> {
    scan.paths
        .iter()
        .filter_map(|p| resolve(module, p, known))
        .filter(|used| {
            !used.is_empty()
                && used != module
                && !(module.is_empty() || used.starts_with(&format!("{module}::")))
        })
        .collect()
}

/// The modules left in cycles: repeatedly take out the modules that use no module left.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> BTreeMap<&str, Vec<&str>> {
    let mut left: BTreeMap<&str, Vec<&str>> = graph
        .iter()
        .map(|(m, e)| (m.as_str(), e.iter().map(String::as_str).collect()))
        .collect();
    loop {
        let free: Vec<&str> = left
            .iter()
            .filter(|(_, uses)| uses.iter().all(|u| !left.contains_key(u)))
            .map(|(m, _)| *m)
            .collect();
        if free.is_empty() {
            return left;
        }
        for m in free {
            left.remove(m);
        }
    }
}

/// One crate's shipped modules: each one's file and what it names.
struct Crate {
    modules: BTreeMap<String, Module>,
    /// The modules' scans, test code left out.
    scans: BTreeMap<String, Scan>,
    /// Each module's edges to the crate's other modules ([`edges`]).
    graph: BTreeMap<String, BTreeSet<String>>,
}

fn read_crate(src: &Path) -> Crate {
    let modules = modules(src);
    let mut scans: BTreeMap<String, Scan> = BTreeMap::new();
    for (module, m) in &modules {
        let mut scan = Scan::default();
        scan.visit_file(&m.ast);
        scans.insert(module.clone(), scan);
    }
    // Files declared by `#[cfg(test)] mod x;`, and everything under them, are test code.
    let tests: Vec<String> = scans
        .iter()
        .flat_map(|(module, scan)| {
            scan.test_children.iter().map(move |c| {
                if module.is_empty() {
                    c.clone()
                } else {
                    format!("{module}::{c}")
                }
            })
        })
        .collect();
    let is_test = |m: &str| {
        tests
            .iter()
            .any(|t| m == t || m.starts_with(&format!("{t}::")))
    };
    scans.retain(|module, _| !is_test(module));
    let graph = scans
        .iter()
        .map(|(module, scan)| {
            let e = edges(module, scan, &modules)
                .into_iter()
                .filter(|u| !is_test(u))
                .collect();
            (module.clone(), e)
        })
        .collect();
    Crate {
        modules,
        scans,
        graph,
    }
}

/// The crate's files over [`MAX_FILE_LINES`] and functions over [`MAX_FN_LINES`].
fn too_long(c: &Crate) -> Vec<String> {
    let mut out = Vec::new();
    for (module, scan) in &c.scans {
        let m = &c.modules[module];
        let relative = m.path.strip_prefix(workspace()).unwrap_or(&m.path);
        let lines = m.text.lines().count();
        if lines > MAX_FILE_LINES {
            out.push(format!(
                "{}: {lines} lines (at most {MAX_FILE_LINES})",
                relative.display()
            ));
        }
        for (function, line, length) in &scan.functions {
            if *length > MAX_FN_LINES {
                out.push(format!(
                    "{}:{line}: fn {function} is {length} lines (at most {MAX_FN_LINES})",
                    relative.display()
                ));
            }
        }
    }
    out
}

#[test]
fn every_crate_is_free_of_module_cycles_long_files_and_long_functions() {
    let mut wrong = Vec::new();
    for (name, src) in crates() {
        let c = read_crate(&src);
        if !NOT_SHIPPED.contains(&name.as_str()) {
            wrong.extend(too_long(&c));
        }
        println!("{name}:");
        for (module, e) in &c.graph {
            let shown: Vec<&str> = e.iter().map(String::as_str).collect();
            let module = if module.is_empty() { "(root)" } else { module };
            println!("  {module:<28} -> {}", shown.join(", "));
        }
        let left = cycles(&c.graph);
        if !left.is_empty() {
            wrong.push(format!("{name}: a module cycle among {left:?}"));
        }
    }
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

/// The router's layers, from the top: a module's layer is that of the first prefix it starts
/// with (docs/architecture.md, "The router's layers").
const ROUTER_LAYERS: [(&str, &[&str]); 5] = [
    ("the crate root", &["", "simulation", "fuzzing"]),
    ("api", &["api"]),
    ("dispatch", &["dispatch"]),
    ("cluster", &["cluster"]),
    ("shared", &["auth", "config", "error", "ids", "metrics"]),
];

fn router_layer(module: &str) -> usize {
    let top = module.split("::").next().unwrap_or("");
    ROUTER_LAYERS
        .iter()
        .position(|(_, prefixes)| prefixes.contains(&top))
        .unwrap_or_else(|| panic!("module {module} is in no layer: add it to ROUTER_LAYERS"))
}

/// The router's modules sit in layers (the API front, dispatch, the cluster view, over shared
/// modules): no module names one of a layer above its own.
#[test]
fn the_routers_modules_use_their_own_layer_and_those_below() {
    let c = read_crate(&workspace().join("router").join("src"));
    let wrong: Vec<String> = c
        .graph
        .iter()
        .filter(|(module, _)| !module.is_empty())
        .flat_map(|(module, edges)| {
            edges
                .iter()
                .filter(|used| router_layer(used) < router_layer(module))
                .map(move |used| {
                    format!(
                        "{module} ({}) uses {used} ({}), a layer up",
                        ROUTER_LAYERS[router_layer(module)].0,
                        ROUTER_LAYERS[router_layer(used)].0
                    )
                })
        })
        .collect();
    assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
}

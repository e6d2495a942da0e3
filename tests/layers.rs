//! No two files of the project import each other, directly or around a
//! circle: each crate's files form layers, read from the top down. A file's
//! imports are the `crate::`, `super::` and `self::` paths it names (in `use`
//! lists and in code), each resolved to the file that defines the deepest
//! module it names. A folder's `mod.rs` (or a crate's `lib.rs`/`main.rs`) is
//! the folder's face: its children may use what it declares, so edges to an
//! ancestor's face are not counted.
//!
//! Run alone: `cargo test --test layers`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[path = "support/circles.rs"]
mod circles;
use circles::circles;

/// The trees whose files must not import each other in a circle.
const TREES: &[&str] = &[
    "src",
    "crates/api/src",
    "crates/engine/src",
    "crates/history/src",
    "plugin/src",
    "e2e/src",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {dir:?}: {e}")) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The directory of the crate `file` belongs to: the nearest ancestor with a
/// `lib.rs` or `main.rs`, or the file itself for a one-file binary.
fn crate_root(file: &Path, tree: &Path) -> PathBuf {
    if file.parent() == Some(&tree.join("bin")) {
        return file.to_path_buf();
    }
    let mut dir = file.parent().expect("a file has a folder");
    loop {
        if dir.join("lib.rs").is_file() || dir.join("main.rs").is_file() || dir == tree {
            return dir.to_path_buf();
        }
        dir = dir.parent().expect("inside the tree");
    }
}

/// The module path of `file` inside the crate rooted at `root`.
fn module_of(file: &Path, root: &Path) -> Vec<String> {
    if file == root {
        return Vec::new();
    }
    let rel = file.strip_prefix(root).expect("under its root");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_owned());
    }
    parts
}

/// Every `use` statement expanded to whole paths (`a::{b, c::d}` → `a::b`,
/// `a::c::d`), plus the paths written in code.
fn paths_in(text: &str) -> Vec<String> {
    fn expand(prefix: &str, body: &str, out: &mut Vec<String>) {
        let body = body.trim();
        if let Some(open) = body.find('{') {
            let head = body[..open].trim_end_matches("::").trim();
            let Some(close) = body.rfind('}').filter(|c| *c > open) else {
                return;
            };
            let inner = &body[open + 1..close];
            let base = join(prefix, head);
            let (mut depth, mut start) = (0, 0);
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&base, &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            expand(&base, &inner[start..], out);
        } else if !body.is_empty() {
            let path = body.split(" as ").next().expect("a path").trim();
            out.push(join(prefix, path));
        }
    }
    fn join(a: &str, b: &str) -> String {
        match (a.is_empty(), b.is_empty()) {
            (true, _) => b.to_owned(),
            (_, true) => a.to_owned(),
            _ => format!("{a}::{b}"),
        }
    }
    let code: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let uses =
        regex::Regex::new(r"(?ms)^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);").expect("a regex");
    for c in uses.captures_iter(&code) {
        expand("", &c[1], &mut out);
    }
    let inline =
        regex::Regex::new(r"\b(?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+").expect("a regex");
    out.extend(inline.find_iter(&code).map(|m| m.as_str().to_owned()));
    out
}

/// The file `path`, written in the module `here`, names; `None` for another
/// crate's path or a name the crate does not define as a file.
fn resolve(path: &str, here: &[String], files: &BTreeMap<Vec<String>, PathBuf>) -> Option<PathBuf> {
    let mut segs = path.split("::");
    let mut module: Vec<String> = match segs.next()? {
        "crate" => Vec::new(),
        "self" => here.to_vec(),
        "super" => {
            let mut m = here.to_vec();
            // `super` in `a/b.rs` (module a::b) is a; in `a/mod.rs` (module a), the root.
            m.pop();
            m
        }
        _ => return None,
    };
    let mut rest: Vec<&str> = segs.collect();
    while rest.first() == Some(&"super") {
        module.pop();
        rest.remove(0);
    }
    let mut best = files.get(&module).cloned();
    for seg in rest {
        module.push(seg.to_owned());
        match files.get(&module) {
            Some(f) => best = Some(f.clone()),
            None => break,
        }
    }
    best
}

/// The import graph of the files under `tree`, test files left out (they
/// sit beside what they test and import it by design).
fn import_graph(tree: &Path) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
    let mut all = Vec::new();
    rust_files(tree, &mut all);
    let mut by_crate: BTreeMap<PathBuf, BTreeMap<Vec<String>, PathBuf>> = BTreeMap::new();
    for f in &all {
        let root = crate_root(f, tree);
        by_crate
            .entry(root.clone())
            .or_default()
            .insert(module_of(f, &root), f.clone());
    }
    let is_test = |f: &Path| {
        f.file_name().is_some_and(|n| n == "tests.rs")
            || f.iter().any(|p| p == "tests" || p == "proptests")
    };
    let is_face = |f: &Path| {
        f.file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs" || n == "main.rs")
    };
    let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
    for f in all.iter().filter(|f| !is_test(f)) {
        let root = crate_root(f, tree);
        let files = &by_crate[&root];
        let here = module_of(f, &root);
        let text = std::fs::read_to_string(f).expect("a readable source file");
        let targets = edges.entry(f.clone()).or_default();
        for path in paths_in(&text) {
            let Some(to) = resolve(&path, &here, files) else {
                continue;
            };
            let to_module = module_of(&to, &root);
            // An ancestor's face (the folder's mod.rs, the crate root) is not
            // an import edge: the folder declares its children.
            let ancestor = here.starts_with(&to_module) && is_face(&to);
            if to != *f && !is_test(&to) && !ancestor {
                targets.insert(to);
            }
        }
    }
    edges
}

#[test]
fn no_two_files_import_each_other_in_a_circle() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut report = Vec::new();
    let mut files = 0;
    for tree in TREES {
        let graph = import_graph(&repo.join(tree));
        files += graph.len();
        for circle in circles(&graph) {
            let names: Vec<String> = circle
                .iter()
                .map(|p| p.strip_prefix(repo).unwrap_or(p).display().to_string())
                .collect();
            report.push(names.join(" ↔ "));
        }
    }
    assert!(files > 150, "only {files} files read: the trees moved?");
    assert!(
        report.is_empty(),
        "import circles (split by concern: move what both use below both):\n{}",
        report.join("\n")
    );
}

/// The check sees a circle when there is one: two files naming each other.
#[test]
fn a_circle_between_two_files_is_found() {
    let dir = std::env::temp_dir().join(format!("layers-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("a")).expect("a temp folder");
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\n").expect("write");
    std::fs::write(dir.join("a/mod.rs"), "mod x;\nmod y;\n").expect("write");
    std::fs::write(dir.join("a/x.rs"), "use super::y::Y;\npub struct X;\n").expect("write");
    std::fs::write(
        dir.join("a/y.rs"),
        "pub struct Y;\nfn f() -> crate::a::x::X { todo!() }\n",
    )
    .expect("write");
    std::fs::write(dir.join("b.rs"), "use crate::a::{x::X, y};\n").expect("write");
    let graph = import_graph(&dir);
    let found = circles(&graph);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(found, vec![vec![dir.join("a/x.rs"), dir.join("a/y.rs")]]);
}

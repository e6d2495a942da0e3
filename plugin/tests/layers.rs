//! The plugin's files import downward only: `cli` on top, a file per command
//! under `commands/`, the console, then `render`, `identity` and `client` at
//! the bottom. Two files that reach each other, directly or around a circle,
//! are one seam to cut; this test reads `plugin/src` and names any circle.
//!
//! An edge is any path from one file into another: a `use crate::…`,
//! `use super::…` or inline `crate::x::f()`, and a parent's path into a child
//! module (`view::User` in `console/mod.rs`). Test modules count too.
//!
//! `cargo test -p kubectl-agentrun --test layers -- --nocapture` prints every
//! edge and every circle (of another tree with `LAYERS_SRC=…/plugin/src`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

#[path = "../../tests/support/circles.rs"]
mod circles;
use circles::circles;

/// A file of `plugin/src` and the module it is (`console/view.rs` is
/// `console::view`; `main.rs` is the binary, which sees the library as
/// `kubectl_agentrun`).
struct File {
    rel: String,
    module: Vec<String>,
    text: String,
}

fn files() -> Vec<File> {
    // Another tree may be measured: LAYERS_SRC=path/to/plugin/src.
    let root = std::env::var_os("LAYERS_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut out = Vec::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.push(File {
                    module: module_of(Path::new(&rel)),
                    text: std::fs::read_to_string(&path).unwrap(),
                    rel,
                });
            }
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    out
}

fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path,
    Open,
    Close,
    Punct(char),
}

/// The tokens that paths are made of; comments, strings and character
/// literals are skipped.
fn tokens(text: &str) -> Vec<Tok> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == 'r' && matches!(next, Some('"' | '#')) && raw_string_end(&c, i).is_some() {
            i = raw_string_end(&c, i).unwrap();
        } else if ch == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if ch == '\'' {
            // A character literal ('x', '\n', '\u{..}'), or a lifetime.
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ch == ':' && next == Some(':') {
            out.push(Tok::Path);
            i += 2;
        } else {
            out.push(match ch {
                '{' => Tok::Open,
                '}' => Tok::Close,
                _ => Tok::Punct(ch),
            });
            i += 1;
        }
    }
    out.retain(|t| !matches!(t, Tok::Punct(c) if c.is_whitespace()));
    out
}

/// Where a raw string starting at `i` (`r"…"`, `r#"…"#`) ends, if it is one.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    let mut j = i + 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && (1..=hashes).all(|h| c.get(j + h) == Some(&'#')) {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    None
}

/// The paths of a `use` tree starting at `toks[i]`, expanded
/// (`a::{b, c::d}` is `a::b` and `a::c::d`); returns where it ended.
fn use_tree(toks: &[Tok], mut i: usize, prefix: &[String], out: &mut Vec<Vec<String>>) -> usize {
    let mut path = prefix.to_vec();
    loop {
        match toks.get(i) {
            Some(Tok::Ident(s)) if s != "as" => {
                path.push(s.clone());
                i += 1;
            }
            Some(Tok::Path) => i += 1,
            Some(Tok::Open) => {
                i += 1;
                loop {
                    match toks.get(i) {
                        Some(Tok::Close) => return i + 1,
                        Some(Tok::Punct(',')) => i += 1,
                        None => return i,
                        _ => i = use_tree(toks, i, &path, out),
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                out.push(path);
                return i + 1;
            }
            Some(Tok::Ident(_)) => {
                // `as name`
                out.push(path);
                return i + 2;
            }
            _ => {
                out.push(path);
                return i;
            }
        }
    }
}

/// The files `f` reaches.
fn edges(f: &File, modules: &BTreeMap<Vec<String>, String>) -> BTreeSet<String> {
    let toks = tokens(&f.text);
    let krate = if f.rel == "main.rs" {
        "kubectl_agentrun"
    } else {
        "crate"
    };
    // The file modules declared here (`mod view;`), which paths may start with.
    let children: BTreeSet<String> = toks
        .windows(3)
        .filter_map(|w| match w {
            [Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')] if m == "mod" => Some(name.clone()),
            _ => None,
        })
        .collect();
    let mut paths: Vec<(Vec<String>, Vec<String>)> = Vec::new();
    // The inline modules (`mod tests { … }`) the tokens are in, with the
    // brace depth each opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < toks.len() {
        let here: Vec<String> = f
            .module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(m, _)| m.clone()))
            .collect();
        match &toks[i] {
            Tok::Open => depth += 1,
            Tok::Close => {
                depth -= 1;
                if inline.last().is_some_and(|(_, d)| *d > depth) {
                    inline.pop();
                }
            }
            Tok::Ident(m)
                if m == "mod"
                    && matches!(toks.get(i + 1), Some(Tok::Ident(_)))
                    && toks.get(i + 2) == Some(&Tok::Open) =>
            {
                if let Some(Tok::Ident(name)) = toks.get(i + 1) {
                    inline.push((name.clone(), depth + 1));
                }
                depth += 1;
                i += 3;
                continue;
            }
            Tok::Ident(u) if u == "use" => {
                let mut found = Vec::new();
                i = use_tree(&toks, i + 1, &[], &mut found);
                paths.extend(found.into_iter().map(|p| (here.clone(), p)));
                continue;
            }
            Tok::Ident(first) if i == 0 || toks[i - 1] != Tok::Path => {
                let mut path = vec![first.clone()];
                let mut j = i + 1;
                while toks.get(j) == Some(&Tok::Path) {
                    match toks.get(j + 1) {
                        Some(Tok::Ident(s)) => path.push(s.clone()),
                        _ => break,
                    }
                    j += 2;
                }
                if path.len() > 1 {
                    paths.push((here.clone(), path));
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    let mut out = BTreeSet::new();
    for (here, path) in paths {
        let mut segs = path.iter().peekable();
        let mut at: Vec<String> = match segs.peek().map(|s| s.as_str()) {
            Some(k) if k == krate => {
                segs.next();
                Vec::new()
            }
            Some("self") => {
                segs.next();
                here.clone()
            }
            Some("super") => {
                let mut at = here.clone();
                while segs.peek().map(|s| s.as_str()) == Some("super") {
                    segs.next();
                    at.pop();
                }
                at
            }
            Some(child) if children.contains(child) => f.module.clone(),
            _ => continue,
        };
        // The deepest file module the path names.
        for s in segs {
            at.push(s.clone());
            if !modules.contains_key(&at) {
                at.pop();
                break;
            }
        }
        while !modules.contains_key(&at) {
            at.pop();
        }
        let target = &modules[&at];
        if *target != f.rel {
            out.insert(target.clone());
        }
    }
    out
}

/// Every file's edges, keyed by file.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let files = files();
    let modules: BTreeMap<Vec<String>, String> = files
        .iter()
        .filter(|f| f.rel != "main.rs")
        .map(|f| (f.module.clone(), f.rel.clone()))
        .collect();
    files
        .iter()
        .map(|f| (f.rel.clone(), edges(f, &modules)))
        .collect()
}

#[test]
fn no_two_plugin_files_import_each_other_around_a_circle() {
    let g = graph();
    for (file, to) in &g {
        let to: Vec<&str> = to.iter().map(String::as_str).collect();
        println!("{file} -> {}", to.join(" "));
    }
    let found = circles(&g);
    for c in &found {
        let inner: Vec<String> = c
            .iter()
            .flat_map(|f| {
                g[f].iter()
                    .filter(|t| c.contains(t))
                    .map(move |t| format!("{f} -> {t}"))
            })
            .collect();
        println!(
            "circle through {} files: {}\n  {}",
            c.len(),
            c.join(" "),
            inner.join("\n  ")
        );
    }
    assert!(
        found.is_empty(),
        "{} circle(s) among plugin/src files",
        found.len()
    );
}

/// Neither the commands nor the console reach `cli`; the console reaches no
/// command's file (what a console page shares with a command lives below
/// both); and what lies below both reaches neither.
#[test]
fn commands_and_the_console_import_only_downward() {
    let g = graph();
    let top = |t: &str| t == "cli.rs";
    let command = |t: &str| t.starts_with("commands/");
    let console = |t: &str| t.starts_with("console/");
    let mut wrong = Vec::new();
    for (file, to) in &g {
        let f = file.as_str();
        let below = !(top(f) || command(f) || console(f) || f == "main.rs" || f == "lib.rs");
        for t in to {
            let up = (command(f) || console(f)) && top(t)
                || console(f) && command(t)
                || below && (top(t) || command(t) || console(t));
            if up {
                wrong.push(format!("{file} -> {t}"));
            }
        }
    }
    assert!(wrong.is_empty(), "imports upward: {wrong:?}");
}

/// The reader sees what this test is for: a circle it plants is found.
#[test]
fn a_planted_circle_is_found() {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let edge = |g: &mut BTreeMap<String, BTreeSet<String>>, a: &str, b: &str| {
        g.entry(a.into()).or_default().insert(b.into());
        g.entry(b.into()).or_default();
    };
    edge(&mut g, "cli.rs", "commands/logs.rs");
    edge(&mut g, "commands/logs.rs", "client.rs");
    assert!(circles(&g).is_empty());
    edge(&mut g, "client.rs", "cli.rs");
    assert_eq!(
        circles(&g),
        [["cli.rs", "client.rs", "commands/logs.rs"]
            .map(String::from)
            .to_vec()]
    );
}

/// The token reader sees the paths a file has, and none in its comments and
/// strings.
#[test]
fn paths_are_read_from_code_only() {
    let modules: BTreeMap<Vec<String>, String> = [
        (vec![], "lib.rs"),
        (vec!["console".into()], "console/mod.rs"),
        (vec!["console".into(), "auth".into()], "console/auth.rs"),
        (vec!["console".into(), "proxy".into()], "console/proxy.rs"),
        (vec!["client".into()], "client.rs"),
        (vec!["render".into()], "render/mod.rs"),
    ]
    .into_iter()
    .map(|(m, f)| (m, f.to_owned()))
    .collect();
    let f = File {
        rel: "console/proxy.rs".into(),
        module: vec!["console".into(), "proxy".into()],
        text: r##"
            // use crate::render;
            use crate::{client::{Error, api}, console::Scope as S};
            fn f() { let s = "crate::render::x"; let r = r#"crate::render"#; let c = '"'; }
            fn g<'a>(x: &'a str) { crate::client::whoami(); }
            #[cfg(test)]
            mod tests { use super::super::auth::tests::headers; }
        "##
        .into(),
    };
    let want: BTreeSet<String> = ["client.rs", "console/auth.rs", "console/mod.rs"]
        .map(String::from)
        .into();
    assert_eq!(edges(&f, &modules), want);
}

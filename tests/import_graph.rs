//! The top-level modules of `src/` import each other without cycles: each layer
//! builds on the ones below it and nothing runs back up. A cycle is how "the
//! consumer owns the topology, the topology needs the consumer's config" starts,
//! and after that no part can be understood, tested or moved alone.
//!
//! Run it with `cargo test -p warren-mq --test import_graph`. It reads the sources,
//! needs no broker or database, and lists each cycle with the files that close it.
//!
//! What counts as an import: every `crate::module` path (in `use` or inline,
//! grouped `crate::{a, b}` too) and every `crate::Name` that `lib.rs` re-exports
//! from a module, outside comments and string literals. Unit-test modules
//! (`#[cfg(test)] mod ...`) are left out: a test may borrow another module's
//! fixtures without that module's code depending on it.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

#[test]
fn top_level_modules_import_each_other_without_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = Graph::read(&src);
    let cycles = graph.cycles();
    assert!(
        cycles.is_empty(),
        "import cycles between the top-level modules of src/:\n{}",
        cycles.join("\n")
    );
}

/// A checker that cannot see an import proves nothing, so the reader is tested
/// on the forms it must recognize.
#[test]
fn the_reader_finds_imports_in_every_form_and_only_in_code() {
    let modules: BTreeSet<String> = ["alpha", "beta", "gamma", "delta", "omega"]
        .map(String::from)
        .into();
    let reexports = BTreeMap::from([("Thing".to_owned(), "gamma".to_owned())]);
    let code = r#"
        use crate::alpha::A;
        use crate::{beta::B, Thing as Other};
        // use crate::omega::Commented;
        /// [`Linked`](crate::omega::Linked)
        const URL: &str = "amqp://host/crate::omega"; /* crate::omega */
        macro_rules! m { () => { $crate::omega::X } }
        fn f<'a>(x: &'a str) -> char { let _ = crate::delta::d(x); '{' }
        #[cfg(test)]
        mod tests {
            use crate::omega::Fixture;
        }
    "#;
    let found = imports(&strip(code), &modules, &reexports);
    assert_eq!(
        found,
        ["alpha", "beta", "gamma", "delta"]
            .map(String::from)
            .into_iter()
            .collect::<BTreeSet<_>>()
    );

    let mut graph = Graph::default();
    for (from, to) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        graph
            .edges
            .entry(from.to_owned())
            .or_default()
            .insert(to.to_owned(), PathBuf::from(format!("src/{from}.rs")));
    }
    let cycles = graph.cycles();
    assert_eq!(cycles.len(), 1, "{cycles:?}");
    assert!(cycles[0].contains("a -> b -> c -> a"), "{}", cycles[0]);
}

/// Which top-level module imports which, with a file that shows each edge.
#[derive(Default)]
struct Graph {
    edges: BTreeMap<String, BTreeMap<String, PathBuf>>,
}

impl Graph {
    fn read(src: &Path) -> Self {
        let files = module_files(src);
        let modules: BTreeSet<String> = files.keys().cloned().collect();
        let lib = strip(&fs::read_to_string(src.join("lib.rs")).expect("src/lib.rs"));
        let reexports = reexports(&lib, &modules);
        let mut graph = Graph::default();
        for (module, paths) in &files {
            for path in paths {
                let code = strip(&fs::read_to_string(path).expect("a source file"));
                for target in imports(&code, &modules, &reexports) {
                    if &target != module {
                        let shown = path
                            .strip_prefix(src.parent().unwrap_or(src))
                            .unwrap_or(path);
                        graph
                            .edges
                            .entry(module.clone())
                            .or_default()
                            .entry(target)
                            .or_insert_with(|| shown.to_owned());
                    }
                }
            }
        }
        graph
    }

    fn targets(&self, module: &str) -> impl Iterator<Item = &String> {
        self.edges.get(module).into_iter().flat_map(BTreeMap::keys)
    }

    /// One line per group of mutually importing modules: a shortest cycle through
    /// the group's first module, then every edge inside the group.
    fn cycles(&self) -> Vec<String> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for module in self.edges.keys() {
            if seen.contains(module) {
                continue;
            }
            let forward = self.reachable(module);
            let group: BTreeSet<String> = forward
                .into_iter()
                .filter(|other| other != module && self.reachable(other).contains(module))
                .chain([module.clone()])
                .collect();
            if group.len() < 2 {
                continue;
            }
            seen.extend(group.iter().cloned());
            let mut line = format!("  {}", self.shortest_cycle(module).join(" -> "));
            for from in &group {
                for to in self.targets(from).filter(|t| group.contains(*t)) {
                    let file = &self.edges[from][to];
                    line.push_str(&format!("\n      {from} -> {to} ({})", file.display()));
                }
            }
            out.push(line);
        }
        out
    }

    fn reachable(&self, start: &str) -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![start.to_owned()];
        while let Some(m) = todo.pop() {
            for t in self.targets(&m) {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    }

    /// Breadth first from `start` back to itself.
    fn shortest_cycle(&self, start: &str) -> Vec<String> {
        let mut parent: BTreeMap<String, String> = BTreeMap::new();
        let mut queue = VecDeque::from([start.to_owned()]);
        while let Some(m) = queue.pop_front() {
            for t in self.targets(&m) {
                if t == start {
                    let mut path = vec![start.to_owned(), m.clone()];
                    let mut at = m.clone();
                    while let Some(p) = parent.get(&at) {
                        path.push(p.clone());
                        at = p.clone();
                    }
                    path.reverse();
                    return path;
                }
                if !parent.contains_key(t) && t != start {
                    parent.insert(t.clone(), m.clone());
                    queue.push_back(t.clone());
                }
            }
        }
        vec![start.to_owned()]
    }
}

/// `src/x.rs` is module `x`; `src/x/mod.rs` and every file under `src/x/` are
/// module `x` too. `lib.rs` and `main.rs` are the root, not a module.
fn module_files(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut files: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in fs::read_dir(src).expect("src/ is readable").flatten() {
        let path = entry.path();
        let Some(name) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else {
            continue;
        };
        if path.is_dir() {
            files.entry(name).or_default().extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main" {
            files.entry(name).or_default().push(path);
        }
    }
    files
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir)
        .expect("a readable module folder")
        .flatten()
    {
        let path = entry.path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// Root names `lib.rs` re-exports, mapped to the module they come from, so that
/// `crate::Error` counts as an import of `error`.
fn reexports(lib: &str, modules: &BTreeSet<String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for statement in lib.split(';') {
        let Some(path) = statement.trim().strip_prefix("pub use ") else {
            continue;
        };
        let mut words = identifiers(path);
        let Some(module) = words.next().filter(|m| modules.contains(*m)) else {
            continue;
        };
        for name in words.filter(|w| *w != "as" && *w != "self") {
            out.insert(name.to_owned(), module.to_owned());
        }
    }
    out
}

fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
}

/// The modules `code` (already stripped) names through `crate::`.
fn imports(
    code: &str,
    modules: &BTreeSet<String>,
    reexports: &BTreeMap<String, String>,
) -> BTreeSet<String> {
    let code = without_test_modules(code);
    let resolve = |name: &str| {
        if modules.contains(name) {
            Some(name.to_owned())
        } else {
            reexports.get(name).cloned()
        }
    };
    let mut found = BTreeSet::new();
    let bytes = code.as_bytes();
    for (at, _) in code.match_indices("crate::") {
        let before = at.checked_sub(1).map(|i| bytes[i] as char);
        // `$crate::` is a macro's path to whatever crate expands it; `my_crate::`
        // is another crate.
        if before.is_some_and(|c| c == '$' || c == '_' || c.is_alphanumeric()) {
            continue;
        }
        let rest = code[at + "crate::".len()..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            for item in top_level_items(group) {
                if let Some(m) = identifiers(item).next().and_then(resolve) {
                    found.insert(m);
                }
            }
        } else if let Some(m) = identifiers(rest).next().and_then(resolve) {
            found.insert(m);
        }
    }
    found
}

/// The comma-separated items of a `{...}` group whose opening brace is already
/// consumed, each with its own nested groups.
fn top_level_items(group: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(&group[start..i]);
                break;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items
}

/// Cuts every `#[cfg(test)] mod name { ... }` out of stripped code.
fn without_test_modules(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        let after = &rest[at + "#[cfg(test)]".len()..];
        let is_module = after.trim_start().starts_with("mod ")
            && after.find('{').is_some_and(|b| !after[..b].contains(';'));
        if !is_module {
            out.push_str(&rest[..at + "#[cfg(test)]".len()]);
            rest = after;
            continue;
        }
        out.push_str(&rest[..at]);
        let open = after.find('{').expect("checked above");
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The code with comments removed and the insides of string and character
/// literals blanked, so neither a doc link nor a URL nor a `'{'` is read as code.
fn strip(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && matches!(next, Some('"' | '#')) && starts_raw_string(&chars, i) {
            // A raw string: r"..." or r#"..."#, closed by a quote and as many #.
            let mut j = i + 1;
            let mut hashes = 0;
            while chars.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            j += 1;
            while j < chars.len() {
                if chars[j] == '"' && (1..=hashes).all(|k| chars.get(j + k) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // A character literal; a lifetime (`'a`) has no closing quote.
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Whether the `r` at `i` opens a raw string (`r"`, `r#"`, `br"`) rather than
/// ending an identifier (`for"` cannot occur, but `var#` in a macro can).
fn starts_raw_string(chars: &[char], i: usize) -> bool {
    let is_ident = |at: Option<usize>| {
        at.and_then(|a| chars.get(a))
            .is_some_and(|c| c.is_alphanumeric() || *c == '_')
    };
    let before = i.checked_sub(1);
    !is_ident(before)
        || (before.is_some_and(|b| chars[b] == 'b')
            && !is_ident(before.and_then(|b| b.checked_sub(1))))
}

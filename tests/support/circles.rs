//! Circles in a graph of files: the strongly connected components of more
//! than one file (Tarjan). Shared by the layer tests (`tests/layers.rs` over
//! every tree, `plugin/tests/layers.rs` over the plugin with its stricter
//! reading of a file's imports).

use std::collections::{BTreeMap, BTreeSet};

/// Each circle's files, sorted; an edge to a file that is not a key is left out.
pub fn circles<N: Ord + Clone>(edges: &BTreeMap<N, BTreeSet<N>>) -> Vec<Vec<N>> {
    struct State<'a, N> {
        edges: &'a BTreeMap<N, BTreeSet<N>>,
        index: BTreeMap<&'a N, usize>,
        low: BTreeMap<&'a N, usize>,
        stack: Vec<&'a N>,
        on_stack: BTreeSet<&'a N>,
        found: Vec<Vec<N>>,
    }
    fn visit<'a, N: Ord + Clone>(s: &mut State<'a, N>, v: &'a N) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(next) = s.edges.get(v) {
            for w in next {
                let Some((w, _)) = s.edges.get_key_value(w) else {
                    continue;
                };
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let low = s.low[v].min(s.low[w]);
                    s.low.insert(v, low);
                } else if s.on_stack.contains(w) {
                    let low = s.low[v].min(s.index[w]);
                    s.low.insert(v, low);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().expect("on the stack");
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

//! CEL that a run's author wrote (a step's `when`), evaluated with a bound on
//! its cost (D22), the way the API server bounds its own CEL rules.
//!
//! The expression is metered as it runs: each iteration of a comprehension
//! (`all`, `exists`, `exists_one`, `map`, `filter`) costs the nodes of its
//! body, and each operation costs the size of its operands (a list's
//! elements, a string's bytes), so concatenation, membership and comparison
//! pay for what they touch. Past its budget the expression stops at the next
//! iteration of whichever loop it is in and the evaluation fails with
//! [`Failure::Cost`]; the same happens as soon as the caller raises the
//! interrupt, which is how the controller's deadline reaches an evaluation
//! without the engine reading a clock ([`Limits::interrupt`]).
//!
//! Message construction (`Foo{…}`) is refused when the expression is
//! compiled: the CEL implementation cannot evaluate it (it panics), and no
//! expression over JSON results needs it.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedExpr, LiteralValue, operators,
};
use cel::{Context, ExecutionError, Value};

/// What one evaluation may spend, in the units described in the module
/// docs: 89 ms of one core in a release build (docs/performance-history.md,
/// "What a step's `when` may cost"), and the API server's own limit per
/// expression.
pub const COST_LIMIT: u64 = 1_000_000;

/// Function names the metering adds; an author's expression cannot call
/// them (they are refused by [`compile`]).
const LOOP: &str = "__agentrun_loop";
const SIZE: &str = "__agentrun_size";

/// The bounds of one evaluation.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Cost units the evaluation may spend.
    pub cost: u64,
    /// Raised by the caller when the evaluation's deadline has passed.
    pub interrupt: Option<Arc<AtomicBool>>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            cost: COST_LIMIT,
            interrupt: None,
        }
    }
}

/// Why an evaluation gave no value.
#[derive(Clone, Debug, PartialEq)]
pub enum Failure {
    /// CEL's own error (a missing field, a wrong type).
    Error(String),
    /// The expression spent its budget.
    Cost { limit: u64 },
    /// The caller's deadline passed first.
    Interrupted,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Error(e) => write!(f, "CEL error: {e}"),
            Failure::Cost { limit } => write!(
                f,
                "exceeds the cost budget of {limit} an expression may spend; it was stopped (simplify it: fewer nested loops over the results)"
            ),
            Failure::Interrupted => {
                write!(f, "was stopped at its evaluation deadline")
            }
        }
    }
}

/// A parsed expression, with the metering woven in.
#[derive(Debug)]
pub struct Bounded {
    /// As the author wrote it, for whoever reads what it refers to.
    source: IdedExpr,
    metered: IdedExpr,
}

impl Bounded {
    /// The expression as written.
    pub fn expression(&self) -> &IdedExpr {
        &self.source
    }
}

/// Parses `text` and prepares it for a bounded evaluation; refuses what
/// cannot be evaluated.
pub fn compile(text: &str) -> Result<Bounded, String> {
    // The parser of this CEL version panics on some malformed input; a spec
    // must never crash the operator (D13).
    let program = match catch_unwind(|| cel::Program::compile(text)) {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            let first = e.to_string();
            let first = first.lines().next().unwrap_or("").trim();
            return Err(format!("does not parse as CEL: {first}"));
        }
        Err(_) => return Err("does not parse as CEL".into()),
    };
    let source = program.expression().clone();
    refuse_unsupported(&source)?;
    let mut metered = source.clone();
    meter(&mut metered);
    Ok(Bounded { source, metered })
}

fn refuse_unsupported(e: &IdedExpr) -> Result<(), String> {
    let mut err = None;
    visit(e, &mut |x| {
        if err.is_some() {
            return;
        }
        match &x.expr {
            Expr::Struct(s) => {
                err = Some(format!(
                    "builds a message ({}{{…}}), which is not supported: results are JSON, read them as maps and lists",
                    s.type_name
                ))
            }
            Expr::Unspecified => err = Some("has an empty expression".into()),
            Expr::Call(c) if c.func_name == LOOP || c.func_name == SIZE => {
                err = Some(format!("calls {}, which is reserved", c.func_name))
            }
            _ => {}
        }
    });
    err.map_or(Ok(()), Err)
}

/// Calls `f` on `e` and every expression inside it.
pub(super) fn visit(e: &IdedExpr, f: &mut impl FnMut(&IdedExpr)) {
    f(e);
    match &e.expr {
        Expr::Select(s) => visit(&s.operand, f),
        Expr::Call(c) => {
            if let Some(t) = &c.target {
                visit(t, f);
            }
            c.args.iter().for_each(|a| visit(a, f));
        }
        Expr::Comprehension(c) => {
            for x in [
                &c.iter_range,
                &c.accu_init,
                &c.loop_cond,
                &c.loop_step,
                &c.result,
            ] {
                visit(x, f);
            }
        }
        Expr::List(l) => l.elements.iter().for_each(|x| visit(x, f)),
        Expr::Map(m) => {
            for entry in &m.entries {
                if let EntryExpr::MapEntry(me) = &entry.expr {
                    visit(&me.key, f);
                    visit(&me.value, f);
                }
            }
        }
        Expr::Struct(s) => {
            for entry in &s.entries {
                if let EntryExpr::StructField(sf) = &entry.expr {
                    visit(&sf.value, f);
                }
            }
        }
        Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

/// Operators that decide which operands they evaluate (and absorb errors,
/// as CEL's logic does): their operands are not charged by size, only what
/// runs inside them.
fn short_circuits(func: &str) -> bool {
    matches!(
        func,
        operators::LOGICAL_AND
            | operators::LOGICAL_OR
            | operators::CONDITIONAL
            | operators::NOT_STRICTLY_FALSE
    )
}

fn call(func: &str, args: Vec<IdedExpr>) -> IdedExpr {
    IdedExpr {
        id: 0,
        expr: Expr::Call(CallExpr {
            func_name: func.to_owned(),
            target: None,
            args,
        }),
    }
}

fn sized(e: IdedExpr) -> IdedExpr {
    call(SIZE, vec![e])
}

/// Weaves the metering into `e`: operands go through [`SIZE`], and every
/// comprehension's loop condition through [`LOOP`] with the weight of one
/// iteration. The loop condition is the one place whose error the
/// interpreter never absorbs: a loop over budget ends there, whatever the
/// logic around it does with the error.
fn meter(e: &mut IdedExpr) {
    match &mut e.expr {
        Expr::Select(s) => meter(&mut s.operand),
        Expr::Call(c) => {
            let charge = !short_circuits(&c.func_name);
            if let Some(t) = &mut c.target {
                meter(t);
                // A target named by an identifier may be a namespace of
                // functions (`math.greatest`): left as it is.
                if charge && !matches!(t.expr, Expr::Ident(_)) {
                    let inner = std::mem::take(t.as_mut());
                    **t = sized(inner);
                }
            }
            for a in &mut c.args {
                meter(a);
                if charge {
                    let inner = std::mem::take(a);
                    *a = sized(inner);
                }
            }
        }
        Expr::Comprehension(c) => {
            let weight = 1 + nodes(&c.loop_step) + nodes(&c.loop_cond);
            let ComprehensionExpr {
                iter_range,
                accu_init,
                loop_cond,
                loop_step,
                result,
                ..
            } = c.as_mut();
            for x in [iter_range, accu_init, loop_step, result] {
                meter(x);
            }
            meter(loop_cond);
            let cond = std::mem::take(loop_cond);
            *loop_cond = call(
                LOOP,
                vec![
                    IdedExpr {
                        id: 0,
                        expr: Expr::Literal(LiteralValue::Int((weight as i64).into())),
                    },
                    cond,
                ],
            );
        }
        Expr::List(l) => l.elements.iter_mut().for_each(meter),
        Expr::Map(m) => {
            for entry in &mut m.entries {
                if let EntryExpr::MapEntry(me) = &mut entry.expr {
                    meter(&mut me.key);
                    meter(&mut me.value);
                }
            }
        }
        Expr::Struct(_) | Expr::Ident(_) | Expr::Literal(_) | Expr::Unspecified => {}
    }
}

/// Nodes evaluated by one pass over `e`; a comprehension inside counts as
/// one (its own iterations are charged by its own loop condition).
fn nodes(e: &IdedExpr) -> u64 {
    match &e.expr {
        Expr::Select(s) => 1 + nodes(&s.operand),
        Expr::Call(c) => {
            1 + c.target.as_deref().map_or(0, nodes) + c.args.iter().map(nodes).sum::<u64>()
        }
        Expr::Comprehension(c) => 1 + nodes(&c.iter_range) + nodes(&c.accu_init),
        Expr::List(l) => 1 + l.elements.iter().map(nodes).sum::<u64>(),
        Expr::Map(m) => {
            1 + m
                .entries
                .iter()
                .map(|entry| match &entry.expr {
                    EntryExpr::MapEntry(me) => nodes(&me.key) + nodes(&me.value),
                    EntryExpr::StructField(sf) => nodes(&sf.value),
                })
                .sum::<u64>()
        }
        _ => 1,
    }
}

/// What a value costs to touch once.
fn size(v: &Value) -> u64 {
    let n = match v {
        Value::List(l) => l.len(),
        Value::Map(m) => m.map.len(),
        Value::String(s) => s.len(),
        Value::Bytes(b) => b.len(),
        _ => 1,
    };
    n.max(1) as u64
}

/// The running total of one evaluation.
struct Meter {
    spent: AtomicU64,
    limit: u64,
    interrupt: Option<Arc<AtomicBool>>,
    over: AtomicBool,
    interrupted: AtomicBool,
}

impl Meter {
    fn charge(&self, units: u64) -> Result<(), ExecutionError> {
        let spent = self.spent.fetch_add(units, Ordering::Relaxed) + units;
        if spent > self.limit {
            self.over.store(true, Ordering::Relaxed);
            return Err(ExecutionError::function_error("cost", "budget spent"));
        }
        if self
            .interrupt
            .as_ref()
            .is_some_and(|i| i.load(Ordering::Relaxed))
        {
            self.interrupted.store(true, Ordering::Relaxed);
            return Err(ExecutionError::function_error("cost", "interrupted"));
        }
        Ok(())
    }
}

/// Evaluates `expr` with the variables `bind` adds, within `limits`.
pub fn evaluate(
    expr: &Bounded,
    bind: impl FnOnce(&mut Context) -> Result<(), String>,
    limits: &Limits,
) -> Result<Value, Failure> {
    let (outcome, meter) = run(expr, bind, limits.cost, limits.interrupt.clone());
    // Checked before the value: CEL's logic may have absorbed the error
    // that stopped the evaluation and produced a value anyway.
    if meter.over.load(Ordering::Relaxed) {
        return Err(Failure::Cost { limit: limits.cost });
    }
    if meter.interrupted.load(Ordering::Relaxed) {
        return Err(Failure::Interrupted);
    }
    outcome
}

/// What `expr` spends on `bind`'s variables when nothing stops it: for the
/// tests and the benchmark that ties a unit to time.
pub fn cost(expr: &Bounded, bind: impl FnOnce(&mut Context) -> Result<(), String>) -> u64 {
    run(expr, bind, u64::MAX, None)
        .1
        .spent
        .load(Ordering::Relaxed)
}

fn run(
    expr: &Bounded,
    bind: impl FnOnce(&mut Context) -> Result<(), String>,
    limit: u64,
    interrupt: Option<Arc<AtomicBool>>,
) -> (Result<Value, Failure>, Arc<Meter>) {
    let meter = Arc::new(Meter {
        spent: AtomicU64::new(0),
        limit,
        interrupt,
        over: AtomicBool::new(false),
        interrupted: AtomicBool::new(false),
    });
    let mut context = Context::default();
    if let Err(e) = bind(&mut context) {
        return (Err(Failure::Error(e)), meter);
    }
    let m = meter.clone();
    context.add_function(
        LOOP,
        move |weight: i64, go: Value| -> Result<Value, ExecutionError> {
            m.charge(weight.max(1) as u64)?;
            Ok(go)
        },
    );
    let m = meter.clone();
    context.add_function(SIZE, move |v: Value| -> Result<Value, ExecutionError> {
        m.charge(size(&v))?;
        Ok(v)
    });
    let outcome = match catch_unwind(AssertUnwindSafe(|| Value::resolve(&expr.metered, &context))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failure::Error(e.to_string())),
        Err(_) => Err(Failure::Error(
            "the CEL implementation failed on this expression".into(),
        )),
    };
    (outcome, meter)
}

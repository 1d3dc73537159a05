//! Lowering: binds hyperparameters from the config, unrolls loops and block
//! calls, resolves checkpoint keys, and builds the op graph with every
//! value's type inferred by the op library's rules.
//!
//! Lowering is an interpreter over the AST: `for` and `if` run at compile
//! time (their bounds and conditions must be compile-time values), blocks are
//! inlined at each call, and each op call adds one node. Each block call and
//! the graph have one flat scope, so an assignment inside a loop or an `if`
//! is visible after it (`h = layer(h)` threads `h` through the layers).
//! It does not check whole-graph properties; that is `valid`'s job.

mod eval;
mod key;

pub use eval::Const;

use std::collections::HashMap;

use crate::config::Config;
use crate::diag::{Error, ErrorKind, Result, Span};
use crate::front::ast::{self, BlockDef, Call, DimExpr, File, ParamType, Stmt, TensorTypeExpr, Value};
use crate::ir::{DType, Graph, Node, NodeId, NodeKind, State, StateDim, TensorType, ValueRef, Weight, CTX};
use crate::ops::{self, AttrKind, AttrValue, Attrs, OpDef};
use eval::{eval, eval_bool, eval_int, eval_str, present, Names};

/// Limits that keep hostile or mistaken graphs from exhausting the machine.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Most nodes in the lowered graph.
    pub max_nodes: usize,
    /// Most loop iterations in all.
    pub max_iterations: u64,
    /// Deepest nesting of block calls.
    pub max_call_depth: usize,
    /// Most elements in one tensor.
    pub max_elements: u64,
    /// Most checkpoint tensors in all (expert families expanded).
    pub max_tensors: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_nodes: 1_000_000,
            max_iterations: 1_000_000,
            max_call_depth: 32,
            max_elements: 1 << 50,
            max_tensors: 8_000_000,
        }
    }
}

/// Lowers a parsed file against a config into an (unvalidated) op graph.
pub fn lower(file: &File, config: &Config, limits: Limits) -> Result<Graph> {
    let mut cx = Lowerer::new(file, config, limits)?;
    let Some(graph) = &file.graph else {
        return Err(Error::new(ErrorKind::Name, "the file has no `graph { ... }`")
            .at(file.model.span)
            .label("this model")
            .help("add a `graph` that reads the token and ends with `output`"));
    };
    cx.graph.span = graph.span;
    let mut frame = Frame::new(String::new(), true);
    cx.exec(&mut frame, &graph.node)?;
    if cx.graph.outputs.is_empty() {
        return Err(Error::new(ErrorKind::Name, "the graph has no `output`")
            .at(graph.span)
            .label("this graph")
            .help("end the graph with `output next_token` (and any other results)"));
    }
    Ok(cx.graph)
}

#[derive(Debug, Clone)]
enum Binding {
    Const(Const),
    Tensor(ValueRef),
}

struct Frame {
    vars: HashMap<String, Binding>,
    prefix: String,
    is_graph: bool,
    returned: Option<Vec<(ValueRef, Span)>>,
}

impl Frame {
    fn new(prefix: String, is_graph: bool) -> Self {
        Frame { vars: HashMap::new(), prefix, is_graph, returned: None }
    }

    fn name(&self, local: &str) -> String {
        if self.prefix.is_empty() {
            local.to_string()
        } else {
            format!("{}/{local}", self.prefix)
        }
    }
}

struct Lowerer<'a> {
    blocks: HashMap<&'a str, &'a BlockDef>,
    globals: HashMap<String, Const>,
    config_root: Const,
    graph: Graph,
    weights_by_key: HashMap<String, NodeId>,
    state_names: HashMap<String, NodeId>,
    names: HashMap<String, u32>,
    tensors: u64,
    iterations: u64,
    depth: usize,
    limits: Limits,
}

struct Scope<'a> {
    frame: &'a Frame,
    cx: &'a Lowerer<'a>,
}

impl Names for Scope<'_> {
    fn lookup(&self, name: &str, span: Span) -> Result<Const> {
        match self.frame.vars.get(name) {
            Some(Binding::Const(c)) => return Ok(c.clone()),
            Some(Binding::Tensor(_)) => {
                return Err(Error::new(ErrorKind::Name, format!("`{name}` is a tensor, not a compile-time value"))
                    .at(span)
                    .label("a tensor")
                    .help("compile-time expressions use params, config keys, loop variables and `let` values"))
            }
            None => {}
        }
        self.cx.global(name, span)
    }
}

fn is_reserved(name: &str) -> bool {
    name == "config" || name == "ctx" || DType::from_name(name).is_some()
}

impl<'a> Lowerer<'a> {
    fn new(file: &'a File, config: &Config, limits: Limits) -> Result<Self> {
        let mut cx = Lowerer {
            blocks: HashMap::new(),
            globals: HashMap::new(),
            config_root: Const::Map(config.root.clone()),
            graph: Graph { model: file.model.node.clone(), ..Graph::default() },
            weights_by_key: HashMap::new(),
            state_names: HashMap::new(),
            names: HashMap::new(),
            tensors: 0,
            iterations: 0,
            depth: 0,
            limits,
        };
        for b in &file.blocks {
            if ops::lookup(&b.name.node).is_some() {
                return Err(Error::new(ErrorKind::Name, format!("block `{}` has the name of an op", b.name.node))
                    .at(b.name.span)
                    .label("rename this block"));
            }
            if cx.blocks.insert(&b.name.node, b).is_some() {
                return Err(Error::new(ErrorKind::Name, format!("block `{}` is defined twice", b.name.node))
                    .at(b.name.span)
                    .label("second definition"));
            }
        }
        for p in &file.params {
            if is_reserved(&p.name.node) {
                return Err(Error::new(ErrorKind::Name, format!("`{}` is a reserved name", p.name.node))
                    .at(p.name.span)
                    .label("choose another name"));
            }
            if cx.globals.contains_key(&p.name.node) {
                return Err(Error::new(ErrorKind::Name, format!("parameter `{}` is defined twice", p.name.node))
                    .at(p.name.span)
                    .label("second definition"));
            }
            let frame = Frame::new(String::new(), false);
            let v = eval(&p.value, &Scope { frame: &frame, cx: &cx })?;
            let v = present(v, p.value.span).map_err(|e| {
                let help = format!("{}; this model's config is {}", e.help.clone().unwrap_or_default(), config.origin);
                e.help(help)
            })?;
            cx.globals.insert(p.name.node.clone(), v);
        }
        Ok(cx)
    }

    fn global(&self, name: &str, span: Span) -> Result<Const> {
        if let Some(v) = self.globals.get(name) {
            return Ok(v.clone());
        }
        if name == "config" {
            return Ok(self.config_root.clone());
        }
        if name == "ctx" {
            return Ok(Const::Ctx);
        }
        if let Some(d) = DType::from_name(name) {
            return Ok(Const::DType(d));
        }
        Err(Error::new(ErrorKind::Name, format!("unknown name `{name}`"))
            .at(span)
            .label("not a param, loop variable or `let` value"))
    }

    fn scope<'b>(&'b self, frame: &'b Frame) -> Scope<'b>
    where
        'a: 'b,
    {
        Scope { frame, cx: self }
    }

    /// `name`, or `name#2`, `name#3`... if it is taken: node names are unique.
    fn unique(&mut self, name: String) -> String {
        let n = self.names.entry(name.clone()).or_insert(0);
        *n += 1;
        if *n > 1 {
            format!("{name}#{n}")
        } else {
            name
        }
    }

    fn add_node(&mut self, mut node: Node) -> Result<NodeId> {
        node.name = self.unique(std::mem::take(&mut node.name));
        if self.graph.g.node_count() >= self.limits.max_nodes {
            return Err(Error::new(ErrorKind::Limit, format!("the graph grows past {} nodes", self.limits.max_nodes))
                .at(node.span)
                .label("while lowering this")
                .help("check loop bounds and config sizes"));
        }
        Ok(self.graph.add(node))
    }

    fn exec(&mut self, frame: &mut Frame, stmts: &'a [Stmt]) -> Result<()> {
        for s in stmts {
            if frame.returned.is_some() {
                break;
            }
            self.stmt(frame, s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, frame: &mut Frame, s: &'a Stmt) -> Result<()> {
        match s {
            Stmt::Weight(w) => self.weight(frame, w),
            Stmt::State { name, ty } => self.state(frame, name, ty),
            Stmt::Input { name, ty } => {
                if !frame.is_graph {
                    return Err(Error::new(ErrorKind::Name, "`input` belongs in the graph, not in a block")
                        .at(name.span)
                        .label("declared in a block"));
                }
                let t = self.tensor_type(frame, ty, false)?;
                let id = self.add_node(Node {
                    kind: NodeKind::Input,
                    outputs: vec![t],
                    name: frame.name(&name.node),
                    span: name.span,
                })?;
                self.bind_tensor(frame, name, ValueRef { node: id, output: 0 })
            }
            Stmt::Output(names) => {
                if !frame.is_graph {
                    return Err(Error::new(ErrorKind::Name, "`output` belongs in the graph; blocks use `return`")
                        .at(names[0].span)
                        .label("in a block"));
                }
                for n in names {
                    let v = self.tensor(frame, n)?;
                    if self.graph.outputs.iter().any(|(o, _)| *o == n.node) {
                        return Err(Error::new(ErrorKind::Name, format!("`{}` is output twice", n.node))
                            .at(n.span)
                            .label("second output"));
                    }
                    self.graph.outputs.push((n.node.clone(), v));
                }
                Ok(())
            }
            Stmt::For { var, lo, hi, body } => {
                let (l, h) = {
                    let sc = self.scope(frame);
                    (eval_int(lo, &sc)?, eval_int(hi, &sc)?)
                };
                if h < l {
                    // A negative count from a config (`num_hidden_layers: -3`)
                    // must not build a model without those layers.
                    return Err(Error::new(ErrorKind::Value, format!("loop range {l}..{h} runs backwards"))
                        .at(hi.span)
                        .label(format!("{h} is below the start {l}"))
                        .help("a count from the config must not be negative"));
                }
                let n = h.saturating_sub(l).max(0) as u64;
                if self.iterations + n > self.limits.max_iterations {
                    return Err(Error::new(
                        ErrorKind::Limit,
                        format!("loops run more than {} iterations in all", self.limits.max_iterations),
                    )
                    .at(lo.span.join(hi.span))
                    .label(format!("{n} iterations")));
                }
                self.iterations += n;
                let saved = frame.prefix.clone();
                for i in l..h {
                    frame.prefix = format!("{saved}{}{}.{i}", if saved.is_empty() { "" } else { "/" }, var.node);
                    frame.vars.insert(var.node.clone(), Binding::Const(Const::Int(i)));
                    self.exec(frame, body)?;
                    if frame.returned.is_some() {
                        break;
                    }
                }
                frame.prefix = saved;
                Ok(())
            }
            Stmt::If { cond, then, otherwise } => {
                let c = eval_bool(cond, &self.scope(frame))?;
                self.exec(frame, if c { then } else { otherwise })
            }
            Stmt::Require { cond, message } => {
                if eval_bool(cond, &self.scope(frame))? {
                    return Ok(());
                }
                let msg = message.as_ref().map_or("requirement failed".to_string(), |m| m.node.clone());
                Err(Error::new(ErrorKind::Require, msg).at(cond.span).label("is false for this config"))
            }
            Stmt::Let { name, value } => {
                let v = present(eval(value, &self.scope(frame))?, value.span)?;
                if is_reserved(&name.node) {
                    return Err(Error::new(ErrorKind::Name, format!("`{}` is a reserved name", name.node))
                        .at(name.span)
                        .label("choose another name"));
                }
                frame.vars.insert(name.node.clone(), Binding::Const(v));
                Ok(())
            }
            Stmt::Return(names) => {
                if frame.is_graph {
                    return Err(Error::new(ErrorKind::Name, "`return` belongs in a block; the graph uses `output`")
                        .at(names[0].span)
                        .label("in the graph"));
                }
                let vals = names.iter().map(|n| Ok((self.tensor(frame, n)?, n.span))).collect::<Result<_>>()?;
                frame.returned = Some(vals);
                Ok(())
            }
            Stmt::Assign { targets, value } => {
                let vals = self.value(frame, value)?;
                if vals.len() != targets.len() {
                    return Err(Error::new(
                        ErrorKind::Call,
                        format!("{} name(s) on the left but the right gives {} value(s)", targets.len(), vals.len()),
                    )
                    .at(value.span())
                    .label(format!("gives {} value(s)", vals.len())));
                }
                let is_op_call = matches!(value, Value::Call(c) if ops::lookup(&c.callee.node).is_some()
                    && !self.blocks.contains_key(c.callee.node.as_str()));
                if let (true, Some(first), Some(v)) = (is_op_call, targets.first(), vals.first()) {
                    if let Some(id) = self.op_id(*v) {
                        let name = self.unique(frame.name(&first.node));
                        self.graph.g[id.0].name = name;
                    }
                }
                for (t, v) in targets.iter().zip(vals) {
                    self.bind_tensor(frame, t, v)?;
                }
                Ok(())
            }
        }
    }

    fn op_id(&self, v: ValueRef) -> Option<NodeId> {
        matches!(self.graph.node(v.node).kind, NodeKind::Op { .. }).then_some(v.node)
    }

    fn bind_tensor(&mut self, frame: &mut Frame, name: &ast::Ident, v: ValueRef) -> Result<()> {
        if is_reserved(&name.node) || self.globals.contains_key(&name.node) {
            return Err(Error::new(
                ErrorKind::Name,
                format!("`{}` is already a parameter or reserved name", name.node),
            )
            .at(name.span)
            .label("choose another name"));
        }
        frame.vars.insert(name.node.clone(), Binding::Tensor(v));
        Ok(())
    }

    fn tensor(&self, frame: &Frame, name: &ast::Ident) -> Result<ValueRef> {
        match frame.vars.get(&name.node) {
            Some(Binding::Tensor(v)) => Ok(*v),
            Some(Binding::Const(c)) => Err(Error::new(
                ErrorKind::Name,
                format!("`{}` is a compile-time {}, not a tensor", name.node, c.type_name()),
            )
            .at(name.span)
            .label("expected a tensor")),
            None if self.globals.contains_key(&name.node) => {
                Err(Error::new(ErrorKind::Name, format!("`{}` is a parameter, not a tensor", name.node))
                    .at(name.span)
                    .label("expected a tensor")
                    .help("pass compile-time values as named arguments: `op(x, eps: eps)`"))
            }
            None => Err(Error::new(ErrorKind::Name, format!("unknown tensor `{}`", name.node))
                .at(name.span)
                .label("not defined before this point")),
        }
    }

    fn dtype(&self, frame: &Frame, id: &ast::Ident) -> Result<DType> {
        match self.scope(frame).lookup(&id.node, id.span) {
            Ok(Const::DType(d)) => Ok(d),
            Ok(other) => {
                Err(Error::new(ErrorKind::Value, format!("`{}` is a {}, not a dtype", id.node, other.type_name()))
                    .at(id.span)
                    .label("expected a dtype"))
            }
            Err(_) => Err(Error::new(ErrorKind::Name, format!("unknown dtype `{}`", id.node))
                .at(id.span)
                .label("not a dtype")
                .help(format!("dtypes: {}", DType::ALL.map(|d| d.name()).join(", ")))),
        }
    }

    /// Evaluates a written tensor type. `ctx` is allowed only in states.
    fn dims(&self, frame: &Frame, ty: &TensorTypeExpr, allow_ctx: bool) -> Result<Vec<StateDim>> {
        let sc = self.scope(frame);
        let mut dims = Vec::with_capacity(ty.dims.len());
        for d in &ty.dims {
            match d {
                DimExpr::Any(span) => {
                    return Err(Error::new(ErrorKind::Value, "`_` is allowed only in block parameter types")
                        .at(*span)
                        .label("give a size"))
                }
                DimExpr::Expr(e) => match present(eval(e, &sc)?, e.span)? {
                    Const::Ctx if allow_ctx => dims.push(StateDim::Ctx),
                    Const::Ctx => {
                        return Err(Error::new(ErrorKind::Value, "`ctx` is a dimension of states only")
                            .at(e.span)
                            .label("not a state"))
                    }
                    _ => {
                        let n = eval_int(e, &sc)?;
                        if n <= 0 {
                            return Err(Error::new(ErrorKind::Value, format!("dimension must be positive, found {n}"))
                                .at(e.span)
                                .label(format!("is {n}")));
                        }
                        dims.push(StateDim::Fixed(n as u64));
                    }
                },
            }
        }
        // A `ctx` dimension counts at the largest context.
        let elements = dims.iter().fold(1u64, |a, d| match d {
            StateDim::Fixed(n) => a.saturating_mul(*n),
            StateDim::Ctx => a.saturating_mul(crate::ir::MAX_CONTEXT),
        });
        if elements > self.limits.max_elements {
            let at = if dims.contains(&StateDim::Ctx) {
                format!(" at the largest context ({} tokens)", crate::ir::MAX_CONTEXT)
            } else {
                String::new()
            };
            return Err(Error::new(ErrorKind::Limit, format!("tensor of {elements} elements{at} is too large"))
                .at(ty.span)
                .label("too large"));
        }
        Ok(dims)
    }

    fn tensor_type(&self, frame: &Frame, ty: &TensorTypeExpr, allow_ctx: bool) -> Result<TensorType> {
        let dtype = self.dtype(frame, &ty.dtype)?;
        let shape = self
            .dims(frame, ty, allow_ctx)?
            .into_iter()
            .map(|d| match d {
                StateDim::Fixed(n) => n,
                StateDim::Ctx => CTX,
            })
            .collect();
        Ok(TensorType::new(dtype, shape))
    }

    fn interpolate(&self, frame: &Frame, key: &str, keep: Option<&str>, span: Span) -> Result<String> {
        let mut out = String::with_capacity(key.len());
        let mut rest = key;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            let Some(close) = after.find('}') else {
                return Err(Error::new(ErrorKind::Value, format!("unclosed `{{` in key \"{key}\""))
                    .at(span)
                    .label("checkpoint key"));
            };
            let name = &after[..close];
            if Some(name) == keep {
                out.push_str(&format!("{{{name}}}"));
            } else {
                match self.scope(frame).lookup(name, span) {
                    Ok(Const::Int(i)) => out.push_str(&i.to_string()),
                    Ok(Const::Str(s)) => out.push_str(&s),
                    Ok(other) => {
                        return Err(Error::new(
                            ErrorKind::Value,
                            format!("`{{{name}}}` in key \"{key}\" is a {}, not an int or string", other.type_name()),
                        )
                        .at(span)
                        .label("checkpoint key"))
                    }
                    Err(_) => {
                        return Err(Error::new(ErrorKind::Name, format!("unknown name `{{{name}}}` in key \"{key}\""))
                            .at(span)
                            .label("checkpoint key")
                            .help("placeholders name a loop variable, block parameter, param or the weight's index"))
                    }
                }
            }
            rest = &after[close + 1..];
        }
        out.push_str(rest);
        Ok(out)
    }

    fn check_key(&self, key: &str, span: Span) -> Result<()> {
        match &self.config_root {
            Const::Map(m) => key::check(key, span, m),
            _ => key::check(key, span, &Default::default()),
        }
    }

    fn weight(&mut self, frame: &mut Frame, w: &'a ast::WeightDecl) -> Result<()> {
        let mut ty = self.tensor_type(frame, &w.ty, false)?;
        let family = match &w.index {
            Some((var, count)) => {
                let n = eval_int(count, &self.scope(frame))?;
                if n <= 0 || n > (1 << 20) {
                    return Err(Error::new(
                        ErrorKind::Value,
                        format!("a weight family needs 1 to 2^20 members, found {n}"),
                    )
                    .at(count.span)
                    .label(format!("is {n}")));
                }
                Some((var.node.clone(), n as u64))
            }
            None => None,
        };
        let keep = family.as_ref().map(|f| f.0.as_str());
        let key_text = eval_str(&w.key, &self.scope(frame))?;
        let key = self.interpolate(frame, &key_text, keep, w.key.span)?;
        self.check_key(&key, w.key.span)?;
        if let Some((var, _)) = &family {
            if !key.contains(&format!("{{{var}}}")) {
                return Err(Error::new(
                    ErrorKind::Value,
                    format!("the key of a weight family must contain `{{{var}}}`"),
                )
                .at(w.key.span)
                .label("every member would have this one key"));
            }
        }
        let scale_key = if ty.dtype.is_block_scaled() {
            let Some(s) = &w.scale else {
                return Err(Error::new(
                    ErrorKind::Value,
                    format!("{} weights need `, scale \"key\"` for their block scales", ty.dtype),
                )
                .at(w.span)
                .label("no scale key"));
            };
            let text = eval_str(s, &self.scope(frame))?;
            let scale = self.interpolate(frame, &text, keep, s.span)?;
            self.check_key(&scale, s.span)?;
            Some(scale)
        } else {
            None
        };
        if ty.dtype == DType::Mxfp4 && ty.row_len() % 32 != 0 {
            return Err(Error::new(
                ErrorKind::Value,
                format!("mxfp4 rows must be a multiple of 32 values, found {}", ty.row_len()),
            )
            .at(w.ty.span)
            .label("last dimension"));
        }
        let stored = ty.clone();
        if let Some((_, n)) = &family {
            ty.shape.insert(0, *n);
        }
        let id = match self.weights_by_key.get(&key) {
            Some(id) => {
                let NodeKind::Weight(prev) = &self.graph.node(*id).kind else {
                    unreachable!("weights map holds weights")
                };
                if prev.ty != stored || prev.family.as_ref().map(|f| f.1) != family.as_ref().map(|f| f.1) {
                    return Err(Error::new(
                        ErrorKind::Value,
                        format!("key \"{key}\" is declared again with another type ({} before)", prev.ty),
                    )
                    .at(w.span)
                    .label(format!("declared {stored} here")));
                }
                *id
            }
            None => {
                let members = family.as_ref().map_or(1, |f| f.1) * if scale_key.is_some() { 2 } else { 1 };
                self.tensors += members;
                if self.tensors > self.limits.max_tensors {
                    return Err(Error::new(
                        ErrorKind::Limit,
                        format!("the graph reads more than {} checkpoint tensors", self.limits.max_tensors),
                    )
                    .at(w.span)
                    .label("while declaring this")
                    .help("check expert counts and loop bounds"));
                }
                let id = self.add_node(Node {
                    kind: NodeKind::Weight(Weight { key: key.clone(), family, scale_key, ty: stored }),
                    outputs: vec![ty],
                    name: frame.name(&w.name.node),
                    span: w.span,
                })?;
                self.weights_by_key.insert(key, id);
                id
            }
        };
        self.bind_tensor(frame, &w.name, ValueRef { node: id, output: 0 })
    }

    fn state(&mut self, frame: &mut Frame, name: &ast::Ident, ty: &TensorTypeExpr) -> Result<()> {
        let dtype = self.dtype(frame, &ty.dtype)?;
        let dims = self.dims(frame, ty, true)?;
        let full = frame.name(&name.node);
        if self.state_names.contains_key(&full) {
            return Err(Error::new(ErrorKind::Name, format!("state `{full}` is declared twice"))
                .at(name.span)
                .label("second declaration"));
        }
        let t = self.tensor_type(frame, ty, true)?;
        let id = self.add_node(Node {
            kind: NodeKind::State(State { dtype, dims }),
            outputs: vec![t],
            name: full.clone(),
            span: name.span,
        })?;
        self.state_names.insert(full, id);
        self.bind_tensor(frame, name, ValueRef { node: id, output: 0 })
    }

    fn value(&mut self, frame: &mut Frame, v: &'a Value) -> Result<Vec<ValueRef>> {
        match v {
            Value::Name(n) => Ok(vec![self.tensor(frame, n)?]),
            Value::Call(call) => {
                if let Some(block) = self.blocks.get(call.callee.node.as_str()).copied() {
                    self.call_block(frame, block, call)
                } else if let Some(def) = ops::lookup(&call.callee.node) {
                    self.call_op(frame, def, call)
                } else {
                    Err(Error::new(ErrorKind::Name, format!("unknown op or block `{}`", call.callee.node))
                        .at(call.callee.span)
                        .label("not an op of the library or a block of this file")
                        .help(suggest(&call.callee.node, &self.blocks)))
                }
            }
        }
    }

    fn single(&mut self, frame: &mut Frame, v: &'a Value) -> Result<ValueRef> {
        let vals = self.value(frame, v)?;
        if vals.len() != 1 {
            return Err(Error::new(
                ErrorKind::Call,
                format!("an argument must be one value, this gives {}", vals.len()),
            )
            .at(v.span())
            .label("assign its results to names first"));
        }
        Ok(vals[0])
    }

    fn call_op(&mut self, frame: &mut Frame, def: &'static OpDef, call: &'a Call) -> Result<Vec<ValueRef>> {
        let required = def.operands.iter().filter(|o| !o.optional).count();
        if call.args.len() < required || call.args.len() > def.operands.len() {
            let names: Vec<_> = def
                .operands
                .iter()
                .map(|o| if o.optional { format!("[{}]", o.name) } else { o.name.to_string() })
                .collect();
            return Err(Error::new(
                ErrorKind::Call,
                format!(
                    "`{}` takes {} operand(s), found {}",
                    def.name,
                    operand_count(required, def.operands.len()),
                    call.args.len()
                ),
            )
            .at(call.span)
            .label(format!("{}({})", def.name, names.join(", "))));
        }
        let mut operands = Vec::with_capacity(call.args.len());
        for (arg, od) in call.args.iter().zip(def.operands) {
            let v = self.single(frame, arg)?;
            let is_state = matches!(self.graph.node(v.node).kind, NodeKind::State(_));
            if od.state && !is_state {
                return Err(Error::new(
                    ErrorKind::Call,
                    format!("operand `{}` of `{}` must be a declared state", od.name, def.name),
                )
                .at(arg.span())
                .label("not a state")
                .help("declare it with `state name: dtype[dims]`"));
            }
            if !od.state && is_state {
                return Err(Error::new(
                    ErrorKind::Call,
                    format!("a state can only be given to an op that updates it, not as `{}`", od.name),
                )
                .at(arg.span())
                .label("a state"));
            }
            operands.push(v);
        }
        let attrs = self.attrs(frame, def, call)?;
        let types: Vec<Option<&TensorType>> =
            (0..def.operands.len()).map(|i| operands.get(i).map(|v| self.graph.value_type(*v))).collect();
        let outputs = (def.infer)(&attrs, &types).map_err(|msg| {
            let shown: Vec<String> = operands
                .iter()
                .zip(def.operands)
                .map(|(v, od)| format!("{}: {}", od.name, self.graph.value_type(*v)))
                .collect();
            Error::new(ErrorKind::Shape, format!("`{}`: {msg}", def.name)).at(call.span).label(shown.join(", "))
        })?;
        let n_out = outputs.len();
        let id = self.add_node(Node {
            kind: NodeKind::Op { op: def.kind, attrs },
            outputs,
            name: frame.name(def.name),
            span: call.span,
        })?;
        for (slot, v) in operands.into_iter().enumerate() {
            self.graph.connect(v, id, slot as u16);
        }
        Ok((0..n_out).map(|o| ValueRef { node: id, output: o as u16 }).collect())
    }

    fn attrs(&self, frame: &Frame, def: &OpDef, call: &Call) -> Result<Attrs> {
        let sc = self.scope(frame);
        let mut attrs = Attrs::default();
        for (name, expr) in &call.named {
            let Some(ad) = def.attrs.iter().find(|a| a.name == name.node) else {
                let known: Vec<_> = def.attrs.iter().map(|a| a.name).collect();
                return Err(Error::new(ErrorKind::Call, format!("`{}` has no attribute `{}`", def.name, name.node))
                    .at(name.span)
                    .label("unknown attribute")
                    .help(if known.is_empty() {
                        format!("`{}` takes no attributes", def.name)
                    } else {
                        format!("attributes: {}", known.join(", "))
                    }));
            };
            if attrs.0.contains_key(ad.name) {
                return Err(Error::new(ErrorKind::Call, format!("attribute `{}` is given twice", ad.name))
                    .at(name.span)
                    .label("second time"));
            }
            let v = present(eval(expr, &sc)?, expr.span)?;
            let bad = || {
                Error::new(
                    ErrorKind::Value,
                    format!(
                        "attribute `{}` of `{}` must be {}, found {} {v}",
                        ad.name,
                        def.name,
                        ad.kind,
                        v.type_name()
                    ),
                )
                .at(expr.span)
                .label(format!("expected {}", ad.kind))
            };
            let av = match (ad.kind, &v) {
                (AttrKind::Int, Const::Int(i)) => AttrValue::Int(*i),
                (AttrKind::Float, Const::Int(i)) => AttrValue::Float(*i as f64),
                (AttrKind::Float, Const::Float(f)) if f.is_finite() => AttrValue::Float(*f),
                (AttrKind::Bool, Const::Bool(b)) => AttrValue::Bool(*b),
                (AttrKind::Choice(choices), Const::Str(s)) if choices.contains(&s.as_str()) => {
                    AttrValue::Str(s.clone())
                }
                (AttrKind::IntList, Const::List(items)) => AttrValue::IntList(
                    items
                        .iter()
                        .map(|x| if let Const::Int(i) = x { Ok(*i) } else { Err(bad()) })
                        .collect::<Result<_>>()?,
                ),
                (AttrKind::DType, Const::DType(d)) => AttrValue::DType(*d),
                _ => return Err(bad()),
            };
            attrs.0.insert(ad.name, av);
        }
        for ad in def.attrs {
            if attrs.0.contains_key(ad.name) {
                continue;
            }
            match ad.default {
                Some(f) => {
                    attrs.0.insert(ad.name, f());
                }
                None => {
                    return Err(Error::new(
                        ErrorKind::Call,
                        format!("`{}` needs attribute `{}` ({})", def.name, ad.name, ad.kind),
                    )
                    .at(call.span)
                    .label(format!("add `{}: ...`", ad.name)))
                }
            }
        }
        Ok(attrs)
    }

    fn call_block(&mut self, frame: &mut Frame, block: &'a BlockDef, call: &'a Call) -> Result<Vec<ValueRef>> {
        if self.depth >= self.limits.max_call_depth {
            return Err(Error::new(
                ErrorKind::Limit,
                format!("block calls nest deeper than {}", self.limits.max_call_depth),
            )
            .at(call.span)
            .label("is a block calling itself?"));
        }
        let mut inner = Frame::new(frame.name(&block.name.node), false);
        let tensor_params: Vec<_> = block.params.iter().filter(|p| matches!(p.ty, ParamType::Tensor(_))).collect();
        if call.args.len() != tensor_params.len() {
            return Err(Error::new(
                ErrorKind::Call,
                format!(
                    "block `{}` takes {} tensor argument(s), found {}",
                    block.name.node,
                    tensor_params.len(),
                    call.args.len()
                ),
            )
            .at(call.span)
            .label(format!(
                "tensors: {}",
                tensor_params.iter().map(|p| p.name.node.as_str()).collect::<Vec<_>>().join(", ")
            ))
            .help("tensors are passed by position; compile-time values by name (`layer: layer`)"));
        }
        for (arg, p) in call.args.iter().zip(&tensor_params) {
            let v = self.single(frame, arg)?;
            let ParamType::Tensor(ty) = &p.ty else { unreachable!("filtered to tensors") };
            self.check_param_type(frame, &inner, ty, v, arg.span(), &p.name.node)?;
            inner.vars.insert(p.name.node.clone(), Binding::Tensor(v));
        }
        for (name, expr) in &call.named {
            let Some(p) = block.params.iter().find(|p| p.name.node == name.node) else {
                return Err(Error::new(
                    ErrorKind::Call,
                    format!("block `{}` has no parameter `{}`", block.name.node, name.node),
                )
                .at(name.span)
                .label("unknown parameter"));
            };
            let ParamType::Const(kind) = &p.ty else {
                return Err(Error::new(
                    ErrorKind::Call,
                    format!("tensor parameter `{}` is passed by position", name.node),
                )
                .at(name.span)
                .label("a tensor parameter"));
            };
            let v = present(eval(expr, &self.scope(frame))?, expr.span)?;
            let ok = matches!(
                (kind.node, &v),
                (ast::ConstKind::Int, Const::Int(_))
                    | (ast::ConstKind::Float, Const::Float(_) | Const::Int(_))
                    | (ast::ConstKind::Bool, Const::Bool(_))
                    | (ast::ConstKind::Str, Const::Str(_))
            );
            if !ok {
                return Err(Error::new(
                    ErrorKind::Value,
                    format!(
                        "parameter `{}` of `{}` takes {:?}, found {} {v}",
                        name.node,
                        block.name.node,
                        kind.node,
                        v.type_name()
                    )
                    .to_lowercase(),
                )
                .at(expr.span)
                .label("wrong type"));
            }
            if inner.vars.insert(name.node.clone(), Binding::Const(v)).is_some() {
                return Err(Error::new(ErrorKind::Call, format!("parameter `{}` is given twice", name.node))
                    .at(name.span)
                    .label("second time"));
            }
        }
        if let Some(p) = block.params.iter().find(|p| !inner.vars.contains_key(&p.name.node)) {
            return Err(Error::new(
                ErrorKind::Call,
                format!("block `{}` needs parameter `{}`", block.name.node, p.name.node),
            )
            .at(call.span)
            .label(format!("add `{}: ...`", p.name.node)));
        }
        self.depth += 1;
        let result = self.exec(&mut inner, &block.body);
        self.depth -= 1;
        result?;
        let returned = inner.returned.take().unwrap_or_default();
        if let Some(types) = &block.returns {
            if types.len() != returned.len() {
                return Err(Error::new(
                    ErrorKind::Call,
                    format!(
                        "block `{}` declares {} result(s) but returns {}",
                        block.name.node,
                        types.len(),
                        returned.len()
                    ),
                )
                .at(block.name.span)
                .label("this block"));
            }
            for (ty, (v, span)) in types.iter().zip(&returned) {
                self.check_param_type(&inner, &inner, ty, *v, *span, "result")?;
            }
        }
        if returned.is_empty() {
            return Err(Error::new(ErrorKind::Call, format!("block `{}` returns nothing", block.name.node))
                .at(call.span)
                .label("called for its results")
                .help("end the block with `return name`"));
        }
        Ok(returned.into_iter().map(|(v, _)| v).collect())
    }

    fn check_param_type(
        &self,
        outer: &Frame,
        inner: &Frame,
        ty: &TensorTypeExpr,
        v: ValueRef,
        span: Span,
        what: &str,
    ) -> Result<()> {
        let actual = self.graph.value_type(v).clone();
        let dtype = self.dtype(outer, &ty.dtype)?;
        let mut ok = dtype == actual.dtype && ty.dims.len() == actual.shape.len();
        let mut expected = Vec::new();
        for (i, d) in ty.dims.iter().enumerate() {
            match d {
                DimExpr::Any(_) => expected.push("_".to_string()),
                DimExpr::Expr(e) => {
                    let n = eval_int(e, &self.scope(inner))?;
                    expected.push(n.to_string());
                    if actual.shape.get(i).map(|a| *a as i64) != Some(n) {
                        ok = false;
                    }
                }
            }
        }
        if !ok {
            return Err(Error::new(
                ErrorKind::Shape,
                format!("`{what}` should be {dtype}[{}], found {actual}", expected.join(", ")),
            )
            .at(span)
            .label(format!("is {actual}")));
        }
        Ok(())
    }
}

fn operand_count(required: usize, total: usize) -> String {
    if required == total {
        required.to_string()
    } else {
        format!("{required} to {total}")
    }
}

fn suggest(name: &str, blocks: &HashMap<&str, &BlockDef>) -> String {
    let mut names: Vec<&str> = ops::library().iter().map(|d| d.name).collect();
    names.extend(blocks.keys());
    let close: Vec<&str> = names.iter().copied().filter(|n| edit_distance(n, name) <= 2).collect();
    if close.is_empty() {
        format!("ops: {}", ops::library().iter().map(|d| d.name).collect::<Vec<_>>().join(", "))
    } else {
        format!("did you mean `{}`?", close.join("` or `"))
    }
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

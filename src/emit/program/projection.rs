//! Projections: a task's weight rows through the page ring, the prologue on
//! its input (none, RMSNorm, KDA's gated norm, an element-wise gate) and the
//! epilogue compiled from the fused nodes in graph order (split, RoPE, add,
//! act-and-mul, RMSNorm, short conv, L2 norm, stack, logits tile
//! max).

use super::*;

impl Gen<'_> {
    pub(super) fn projection(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages = self.stages_of(op);
        let rows_stage = stages[0];
        self.place_outputs(op);
        let inside = |n: NodeId| op.nodes.contains(&n.index());
        let linears: Vec<NodeId> = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .filter(|n| matches!(self.op_of(*n), Some((OpKind::Linear | OpKind::LmHead, _))))
            .collect();
        // The shared input and its prologue.
        let x = g.operands(linears[0])[0];
        for l in &linears {
            if g.operands(*l)[0] != x {
                return Err(unsupported(op, "linears with different inputs in one projection"));
            }
        }
        // The prologue: none, an RMSNorm, KDA's gated output norm, or an
        // element-wise gate (x * sigmoid(g), K3's MLA output gate).
        let gated = op.nodes.contains(&x.node.index()) && matches!(self.op_of(x.node), Some((OpKind::GatedRmsNorm, _)));
        let mul = op.nodes.contains(&x.node.index()) && matches!(self.op_of(x.node), Some((OpKind::Mul, _)));
        let mut mul_gate: Option<(String, u32)> = None;
        let (x_in, x_ptr, norm, eps, gate) = if mul {
            let mops = g.operands(x.node);
            let inside = |v: &ValueRef| op.nodes.contains(&v.node.index());
            // One operand is the value, the other the gate (or its sigmoid, inside).
            let (val, gv) = if inside(&mops[1]) || !inside(&mops[0]) { (mops[0], mops[1]) } else { (mops[1], mops[0]) };
            if inside(&val) {
                return Err(unsupported(op, "a gated input computed inside the operation"));
            }
            let (graw, sig) = if inside(&gv) {
                match self.op_of(gv.node) {
                    Some((OpKind::Sigmoid, _)) if !inside(&g.operands(gv.node)[0]) => (g.operands(gv.node)[0], 1),
                    _ => return Err(unsupported(op, "a gate prologue other than a sigmoid of a value")),
                }
            } else {
                (gv, 0)
            };
            mul_gate = Some((self.value(graw, op)?, sig));
            (val, self.value(val, op)?, "nullptr".to_string(), 1e-6, None)
        } else if gated {
            let (_, attrs) = self.op_of(x.node).expect("an op");
            let gops = g.operands(x.node);
            if gops.iter().take(2).any(|v| op.nodes.contains(&v.node.index())) {
                return Err(unsupported(op, "a prologue of more than one op"));
            }
            let d = g.value_type(gops[2]).elements();
            let act = match attrs.str("act") {
                "sigmoid" => 1,
                "silu" => 0,
                a => return Err(unsupported(op, &format!("a gated norm with act \"{a}\""))),
            };
            let gate = (gops[1], self.value(gops[1], op)?, d, act);
            (gops[0], self.value(gops[0], op)?, self.weight(gops[2].node, 0)?, attrs.float("eps"), Some(gate))
        } else {
            let (x_in, x_ptr, norm, eps) = self.with_norm_prologue(op, x)?;
            (x_in, x_ptr, norm, eps, None)
        };
        let k = g.value_type(x_in).elements();
        if let Some((_, _, d, _)) = &gate {
            if d == &0 || !k.is_multiple_of(*d) {
                return Err(unsupported(op, &format!("a gated-norm prologue over {k} channels in groups of {d}")));
            }
        }
        if !matches!(g.value_type(x).dtype, DType::Bf16 | DType::F32) || !k.is_multiple_of(8) {
            return Err(unsupported(op, "a bf16 or f32 input whose length is a multiple of 8"));
        }
        // bf16 weights, or FP8 (e4m3 with 128 x 128 block scales): every
        // linear of the operation the same.
        let fp8 = g.value_type(g.operands(linears[0])[1]).dtype == DType::Fp8E4m3;
        for l in &linears {
            let w = g.value_type(g.operands(*l)[1]);
            if !matches!(w.dtype, DType::Bf16 | DType::Fp8E4m3) || (w.dtype == DType::Fp8E4m3) != fp8 {
                return Err(unsupported(op, &format!("{} weights ({})", w.dtype.name(), g.node(*l).name)));
            }
        }
        if fp8 && (gate.is_some() || mul_gate.is_some()) {
            return Err(unsupported(op, "FP8 weights behind a gated prologue"));
        }
        // Row sources of each task, by its linear node.
        let rows_t = if fp8 { "Fp8Rows" } else { "Rows" };
        let mut rows = String::new();
        let r = if fp8 {
            init!("Fp8Rows"; w0 = "nullptr", s0 = "nullptr", w1 = "nullptr", s1 = "nullptr", r0 = "t.a[2]", r1 = "t.a[3]", k = k)
        } else {
            init!("Rows"; w0 = "nullptr", w1 = "nullptr", r0 = "t.a[2]", r1 = "t.a[3]", k = k)
        };
        let _ = writeln!(rows, "  {rows_t} r = {r};\n  switch (t.a[0]) {{");
        for (ordinal, l) in linears.iter().enumerate() {
            let wn = g.operands(*l)[1].node;
            let w = self.weight(wn, 0)?;
            let up = op
                .nodes
                .iter()
                .map(|n| nid(*n))
                .find(|n| matches!(self.op_of(*n), Some((OpKind::ActAndMul, _))) && g.operands(*n)[0].node == *l);
            let upw = match up.map(|a| g.operands(a)[1].node) {
                Some(u) if linears.contains(&u) => Some(g.operands(u)[1].node),
                _ => None,
            };
            let w1 = match upw {
                Some(u) => self.weight(u, 0)?,
                None => "nullptr".into(),
            };
            if fp8 {
                let s0 = self.weight_scales(wn)?;
                let s1 = match upw {
                    Some(u) => self.weight_scales(u)?,
                    None => "nullptr".into(),
                };
                let _ = writeln!(rows, "    case {ordinal}: r.w0 = {w}; r.s0 = {s0}; r.w1 = {w1}; r.s1 = {s1}; break;");
            } else {
                let _ = writeln!(rows, "    case {ordinal}: r.w0 = {w}; r.w1 = {w1}; break;");
            }
        }
        let _ = writeln!(rows, "    default: __trap();\n  }}");
        let tasks: Vec<usize> = self.plan.tiling.stages[rows_stage].tasks.clone();
        // A gated input is staged whole (the gated-norm and the multiply-gate
        // prologues); the plain one is read in place when it does not fit.
        let spill = self.spill(rows_stage);

        // The epilogue, in graph order: each value's span in the tile.
        let mut body = String::new();
        let mut span: HashMap<ValueRef, String> = HashMap::new();
        let mut in_op_users: HashMap<ValueRef, usize> = HashMap::new();
        for &n in &op.nodes {
            for v in g.operands(nid(n)) {
                if inside(v.node) {
                    *in_op_users.entry(v).or_default() += 1;
                }
            }
        }
        // Each span's definition (`const Span s1 = ...;`), by name: a verify
        // step's commit computes those its convs need again.
        let mut span_defs: Vec<(String, String)> = vec![];
        let mut new_span = |body: &mut String, expr: String| {
            let name = format!("s{}", span_defs.len() + 1);
            let def = format!("  const Span {name} = {expr};");
            let _ = writeln!(body, "{def}");
            span_defs.push((name.clone(), def));
            name
        };
        // A verify step (positions > 1): the convs' commits.
        let positions = self.plan.options.positions;
        let mut commits: Vec<(String, String)> = vec![];
        let mut lm_tiles = None;
        let mut ropes = 0;
        for &ni in &op.nodes {
            let n = nid(ni);
            let (kind, attrs) = self.op_of(n).expect("an op");
            let ops = g.operands(n);
            let out = ValueRef { node: n, output: 0 };
            let comment = format!("  // {} {}", kind.name(), self.where_short(n));
            let _ = writeln!(body, "{comment}");
            match kind {
                OpKind::RmsNorm | OpKind::GatedRmsNorm | OpKind::Mul if n == x.node => continue,
                OpKind::Sigmoid if mul_gate.is_some() && g.operands(x.node).iter().any(|v| v.node == n) => continue,
                OpKind::Linear | OpKind::LmHead => {
                    let ordinal = linears.iter().position(|l| *l == n).expect("a linear of the op");
                    let s = new_span(&mut body, format!("linear_span(t, {ordinal})"));
                    span.insert(out, s);
                }
                OpKind::ActAndMul => {
                    let gate = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "act_and_mul of values it does not compute"))?;
                    let call = act_and_mul_call(attrs, &gate).map_err(|a| unsupported(op, &a))?;
                    let _ = writeln!(body, "  {call}\n  consumer_sync();");
                    span.insert(out, gate);
                }
                OpKind::Split => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a split of a value it does not compute"))?;
                    let mut off = 0i64;
                    for (o, size) in attrs.int_list("sizes").iter().enumerate() {
                        let s = new_span(&mut body, format!("sub_span({src}, {off}, {size})"));
                        span.insert(ValueRef { node: n, output: o as u16 }, s);
                        off += size;
                    }
                }
                OpKind::Rope => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "RoPE of a value it does not compute"))?;
                    let (inv, mscale) = rope_table(attrs);
                    ropes += 1;
                    let table = format!("@K@_rope{ropes}");
                    let list: Vec<String> = inv.iter().map(|f| float(*f)).collect();
                    let _ = writeln!(
                        self.code,
                        "__device__ const float {table}[{}] = {{{}}};",
                        list.len(),
                        list.join(", ")
                    );
                    let style = match attrs.str("style") {
                        "interleaved" => "true",
                        "neox" => "false",
                        s => return Err(unsupported(op, &format!("RoPE style \"{s}\""))),
                    };
                    let args = init!("EpRope";
                        head_dim = attrs.int("head_dim"),
                        rot = attrs.int("rot"),
                        interleaved = style,
                        inv_freq = table,
                        mscale = float(mscale),
                        pos = "m.pos",
                    );
                    let _ = writeln!(body, "  ep_rope<kBatch>(st, n, {src}, {args});\n  consumer_sync();");
                    span.insert(out, src);
                }
                OpKind::Add => {
                    let (mine, other) = match (span.get(&ops[0]), span.get(&ops[1])) {
                        (Some(s), None) => (s.clone(), ops[1]),
                        (None, Some(s)) => (s.clone(), ops[0]),
                        _ => return Err(unsupported(op, "an add of two values it computes")),
                    };
                    let ptr = self.value(other, op)?;
                    let len = g.value_type(other).elements();
                    let _ = writeln!(body, "  ep_add<kBatch>(st, n, {mine}, {ptr}, {len});\n  consumer_sync();");
                    span.insert(out, mine);
                }
                OpKind::RmsNorm => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "RMSNorm of a value it does not compute"))?;
                    let w = self.weight(ops[1].node, 0)?;
                    let len = g.value_type(ops[0]).elements();
                    if g.value_type(ops[1]).elements() != len {
                        return Err(unsupported(op, "a grouped RMSNorm epilogue"));
                    }
                    let args = init!("EpRmsNorm"; full = len, w = w, eps = float(attrs.float("eps")));
                    let _ = writeln!(body, "  ep_rms_norm<kBatch>(st, n, {src}, {args});\n  consumer_sync();");
                    span.insert(out, src);
                }
                OpKind::Stack => {
                    // The bank with this row appended: the row is a span of the tile.
                    if ops.len() != 2 {
                        return Err(unsupported(op, "a stack epilogue that starts a bank"));
                    }
                    let src = span
                        .get(&ops[1])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a stack of a row it does not compute"))?;
                    if op.nodes.contains(&ops[0].node.index()) {
                        return Err(unsupported(op, "a stack of a bank computed inside the operation"));
                    }
                    let hidden = g.value_type(ops[1]).elements();
                    let rows = g.value_type(ops[0]).elements() / hidden.max(1);
                    let bank = self.value(ops[0], op)?;
                    let dst = self.value(out, op)?;
                    let rows = self.param("bank_rows", Param::Int(rows));
                    let args = init!("EpStack";
                        bank = bank,
                        rows = format!("uint32_t({rows})"),
                        hidden = hidden,
                        bank_new = dst,
                    );
                    let _ = writeln!(body, "  ep_stack<kBatch>(st, n, {src}, {args});");
                    // The stacked bank is stored here, not through a span.
                    continue;
                }
                OpKind::ConvUpdate => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "a short conv of a value it does not compute"))?;
                    let wt = g.value_type(ops[1]);
                    let channels = g.value_type(ops[0]).elements();
                    let width = wt.shape.last().copied().unwrap_or(0);
                    if wt.dtype != DType::F32 || wt.elements() != channels * width || width < 1 {
                        return Err(unsupported(op, "a short conv whose weight is not f32 [channels, 1, width]"));
                    }
                    let NodeKind::State(_) = &g.node(ops[2].node).kind else {
                        return Err(unsupported(op, "a short conv whose state is not state"));
                    };
                    let st_type = g.value_type(ops[2]);
                    let c_type = match st_type.dtype {
                        DType::Bf16 => "__nv_bfloat16",
                        DType::F32 => "float",
                        d => return Err(unsupported(op, &format!("a {} conv state", d.name()))),
                    };
                    if st_type.elements() != (width - 1) * channels {
                        return Err(unsupported(op, "a conv state that is not [width - 1, channels]"));
                    }
                    let silu = match attrs.str("act") {
                        "silu" => 1,
                        "none" => 0,
                        a => return Err(unsupported(op, &format!("a short conv with act \"{a}\""))),
                    };
                    let w = self.weight(ops[1].node, 0)?;
                    let state = self.state(ops[2].node, c_type);
                    let args = init!("EpConvUpdate";
                        w = w,
                        width = width,
                        state = state,
                        state_stride = st_type.elements(),
                        channels = channels,
                        silu = silu,
                    );
                    if positions == 1 {
                        let _ = writeln!(body, "  ep_conv_update<kBatch>(st, n, {src}, {args});\n  consumer_sync();");
                    } else {
                        // The verify step's conv and its commit read the same arguments, with the log.
                        let Some([at]) = self.plan.arena.logs.get(&n.index()).map(Vec::as_slice) else {
                            return Err(internal(op, "a short conv without its verify-step log"));
                        };
                        let log = format!("reinterpret_cast<{c_type}*>({})", self.arena("conv_log", Loc::Arena(*at)));
                        let args = with_field(&args, "log", &log);
                        let conv = format!("@K@_conv{}", commits.len() + 1);
                        let _ = writeln!(
                            self.code,
                            "__device__ inline EpConvUpdate<{c_type}> {conv}(const Memory& m, const @K@_params& p) {{\n  \
                             return {args};\n}}"
                        );
                        let _ = writeln!(
                            body,
                            "  ep_conv_update<kBatch, kPositions>(st, n, {src}, {conv}(m, p));\n  consumer_sync();"
                        );
                        commits.push((src.clone(), conv));
                    }
                    span.insert(out, src);
                }
                OpKind::L2Norm => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "an L2 norm of a value it does not compute"))?;
                    let args = init!("EpL2Norm"; group = attrs.int("group"), eps = float(attrs.float("eps")));
                    let _ = writeln!(body, "  ep_l2_norm<kBatch>(st, n, {src}, {args});\n  consumer_sync();");
                    span.insert(out, src);
                }
                OpKind::Argmax => {
                    let src = span
                        .get(&ops[0])
                        .cloned()
                        .ok_or_else(|| unsupported(op, "argmax of a value it does not compute"))?;
                    let tiles = tasks.len();
                    let at = self.block(op, rows_stage, Block::TileMax)?;
                    let ptr = format!("reinterpret_cast<float2*>({})", self.arena("tile_max", at));
                    let args = init!("EpTileMax"; out = ptr, tile = "t.index", tiles = tiles);
                    let _ = writeln!(body, "  ep_tile_max<kBatch>(st, n, {src}, {args});");
                    lm_tiles = Some((ptr, tiles, out));
                    continue;
                }
                other => return Err(unsupported(op, &format!("a {} epilogue", other.name()))),
            }
            // Values read elsewhere are stored once final.
            for (o, _) in g.node(n).outputs.iter().enumerate() {
                let v = ValueRef { node: n, output: o as u16 };
                if let (Some(slot), Some(s)) = (self.slots.get(&v).cloned(), span.get(&v)) {
                    let len = slot.ty.elements();
                    let ptr = self.slot_ptr(&slot);
                    let _ = writeln!(body, "  ep_store<kBatch>(st, n, {s}, {ptr}, {len});");
                }
            }
            if in_op_users.get(&out).copied().unwrap_or(0) > 1 {
                return Err(unsupported(op, &format!("{} read twice inside the operation", g.node(n).name)));
            }
        }
        self.header(rows_stage, op, "output rows");
        let f = self.fname(op, rows_stage);
        let _ = writeln!(
            self.code,
            "__device__ inline {rows_t} {f}_rows(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n{rows}  return r;\n}}"
        );
        let compute = match (&gate, &mul_gate) {
            (None, None) if fp8 => {
                let args = init!("Fp8RowsCompute"; rows = "r", x = x_ptr, norm = norm, eps = float(eps), spill = spill);
                format!("fp8_rows_compute<kBatch>({args}, it, warp, st);")
            }
            (None, Some((gptr, sig))) => {
                let args = init!("RowsComputeMul"; rows = "r", x = x_ptr, g = gptr, sigmoid_gate = sig, spill = spill);
                format!("rows_compute_mul<kBatch>({args}, it, warp, st);")
            }
            (None, None) => {
                let args = init!("RowsCompute"; rows = "r", x = x_ptr, norm = norm, eps = float(eps));
                format!("rows_compute<kBatch>({args}, it, warp, st);")
            }
            (Some((_, gptr, d, act)), _) => {
                let args = init!("RowsComputeGated";
                    rows = "r",
                    x = x_ptr,
                    gate = gptr,
                    heads = k / d,
                    d = d,
                    w = norm,
                    eps = float(eps),
                    sigmoid_act = act,
                    spill = spill,
                );
                format!("rows_compute_gated<kBatch>({args}, it, warp, st);")
            }
        };
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it, int warp) {{\n  \
             const {rows_t} r = {f}_rows(t, m, p);\n  float* st = staging(m);\n  const uint32_t n = r.cols();\n  \
             {compute}\n  consumer_sync();\n{body}}}"
        );
        let commit = if commits.is_empty() {
            None
        } else {
            // The spans the convs read, in definition order (a sub-span after its parent).
            let mut need: Vec<&str> = commits.iter().map(|(s, _)| s.as_str()).collect();
            let mut code = String::new();
            for (name, def) in span_defs.iter().rev() {
                if need.contains(&name.as_str()) {
                    need.extend(
                        span_defs.iter().filter(|(n, _)| def.contains(&format!("({n},"))).map(|(n, _)| n.as_str()),
                    );
                }
            }
            for (name, def) in &span_defs {
                if need.contains(&name.as_str()) {
                    let _ = writeln!(code, "{def}");
                }
            }
            for (src, conv) in &commits {
                let _ = writeln!(code, "  conv_commit<kBatch, kPositions>({src}, {conv}(m, p), keep);");
            }
            let _ = writeln!(
                self.code,
                "// After a verify step: the conv windows moved on by the positions each sequence keeps.\n\
                 __device__ inline void {f}_commit(const TaskArgs& t, const Memory& m, const @K@_params& p, \
                 const uint32_t* keep) {{\n{code}}}"
            );
            Some(format!("{f}_commit(t, m, p, keep);"))
        };
        self.role_commit(
            rows_stage,
            format!("{f}(t, m, p, it, warp);"),
            Some(if fp8 {
                format!("fp8_rows_load<kBatch>({f}_rows(t, m, p), it);")
            } else {
                format!("rows_load<kBatch>({f}_rows(t, m, p), it);")
            }),
            commit,
        );
        if let Some((ptr, tiles, out)) = lm_tiles {
            let stage = stages[1];
            let dst = self.value(out, op)?;
            self.header(stage, op, "argmax over the row tiles");
            let f = self.fname(op, stage);
            let _ = writeln!(
                self.code,
                "__device__ inline void {f}(const Memory& m, const @K@_params& p) {{\n  argmax_tiles<kBatch>({});\n}}",
                init!("ArgmaxTiles"; tile_max = ptr, tiles = tiles, next = dst)
            );
            self.role(stage, format!("{f}(m, p);"), None);
        }
        Ok(())
    }
}

//! Attention stages: weight-absorbed MLA (the queries absorbed, the split
//! over the KV length, the combine), KDA decode, and K3's attention-residual mix.

use super::*;

impl Gen<'_> {
    pub(super) fn mla(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stages = self.stages_of(op);
        let [absorb, split, combine] = stages[..] else {
            return Err(internal(op, "an MLA operation of three stages (absorb, split, combine)"));
        };
        self.place_outputs(op);
        let n = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .find(|n| matches!(self.op_of(*n), Some((OpKind::MlaDecode, _))))
            .expect("anchor");
        let (_, attrs) = self.op_of(n).expect("an op");
        let ops = g.operands(n);
        let heads = attrs.int("heads") as u64;
        let (nope, rope, v_dim) = (attrs.int("nope"), attrs.int("rope"), attrs.int("v_dim"));
        let c = g.value_type(ops[1]).elements();
        let q = self.value(ops[0], op)?;
        let (_, ckv, norm, eps) = self.with_norm_prologue(op, ops[1])?;
        let kpe = self.value(ops[2], op)?;
        // bf16, or FP8 made bf16 on upload (the plan's weight table says kFp8Bf16).
        let wkvb = self.weight_as(ops[3].node, "__nv_bfloat16")?;
        let NodeKind::State(_) = &g.node(ops[4].node).kind else {
            return Err(unsupported(op, "a cache that is state"));
        };
        let cache = self.state(ops[4].node, "__nv_bfloat16");
        // The output gate, where the planner put it here (`head-gate`): the
        // combine writes o times the gate (or its sigmoid, also here).
        let gate_mul =
            op.nodes.iter().map(|m| nid(*m)).find(|m| {
                matches!(self.op_of(*m), Some((OpKind::Mul, _))) && g.operands(*m).iter().any(|v| v.node == n)
            });
        let (out, gate) = match gate_mul {
            Some(m) => {
                let gv = *g.operands(m).iter().find(|v| v.node != n).expect("a gate operand");
                let (raw, act) = match self.op_of(gv.node) {
                    Some((OpKind::Sigmoid, _)) if op.nodes.contains(&gv.node.index()) => (g.operands(gv.node)[0], 1),
                    _ => (gv, 0),
                };
                if op.nodes.contains(&raw.node.index()) {
                    return Err(unsupported(op, "an MLA output gate other than a value or its sigmoid"));
                }
                (self.value(ValueRef { node: m, output: 0 }, op)?, Some((self.value(raw, op)?, act)))
            }
            None => (self.value(ValueRef { node: n, output: 0 }, op)?, None),
        };
        let ctx = self.plan.options.context;
        let Some((groups, hpt, splits)) = self.plan.tiling.stages[split].mla_split else {
            return Err(internal(op, "an MLA split the tiling did not shape"));
        };
        let at = self.block(op, split, Block::MlaPartials)?;
        let partials = format!("reinterpret_cast<float*>({})", self.arena("partials", at));
        let at = self.block(op, absorb, Block::MlaAbsorbed)?;
        let absorbed = format!("reinterpret_cast<float*>({})", self.arena("absorbed", at));
        let shape = init!("MlaShape";
            heads = heads,
            hpt = hpt,
            groups = groups,
            splits = splits,
            ctx = ctx,
            c = c,
            nope = nope,
            rope = rope,
            v_dim = v_dim,
            scale = float(attrs.float("scale")),
            positions = self.plan.options.positions,
        );
        let _ = writeln!(self.code, "\n__device__ constexpr MlaShape @K@_shape = {shape};");
        self.header(
            absorb,
            op,
            "every token's queries of some heads absorbed into the latent space (W_UK through the page ring)",
        );
        let f = self.fname(op, absorb);
        let load = init!("MlaAbsorbLoad"; shape = "@K@_shape", h0 = "t.a[0]", h1 = "t.a[1]", wkvb = wkvb);
        let args = init!("MlaAbsorb"; shape = "@K@_shape", h0 = "t.a[0]", h1 = "t.a[1]", q = q, absorbed = absorbed);
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}_load(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it) {{\n  \
             mla_absorb_load<kBatch>({load}, it);\n}}\n\
             __device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it) {{\n  \
             mla_absorb_heads<kBatch>({args}, it);\n}}",
        );
        self.role(absorb, format!("{f}(t, m, p, it);"), Some(format!("{f}_load(t, m, p, it);")));
        self.header(split, op, "attention over one KV split (cache rows through the page ring, online softmax)");
        let f = self.fname(op, split);
        let load = init!("MlaSplitLoad";
            shape = "@K@_shape",
            head_group = "t.a[0]",
            split = "t.a[1]",
            cache = cache,
            pos = "m.pos",
        );
        let args = init!("MlaSplit";
            shape = "@K@_shape",
            head_group = "t.a[0]",
            split = "t.a[1]",
            q = q,
            absorbed = absorbed,
            ckv_raw = ckv,
            norm = norm,
            eps = float(eps),
            kpe = kpe,
            cache = cache,
            pos = "m.pos",
            partials = partials,
        );
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}_load(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it) {{\n  \
             mla_split_load<kBatch>({load}, it);\n}}\n\
             __device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it) {{\n  \
             mla_split<kBatch{mma}>({args}, it);\n}}",
            mma = if self.plan.tiling.stages[split].mla_tensor_cores { ", true" } else { "" },
        );
        self.role(split, format!("{f}(t, m, p, it);"), Some(format!("{f}_load(t, m, p, it);")));
        self.header(combine, op, "split merge and value up-projection (W_UV through the page ring)");
        let f = self.fname(op, combine);
        let load = init!("MlaCombineLoad"; shape = "@K@_shape", h0 = "t.a[0]", h1 = "t.a[1]", wkvb = wkvb);
        let mut args = init!("MlaCombine";
            shape = "@K@_shape",
            h0 = "t.a[0]",
            h1 = "t.a[1]",
            partials = partials,
            wkvb = wkvb,
            out = out,
        );
        if let Some((gate, act)) = &gate {
            args = with_field(&with_field(&args, "gate", gate), "gate_sigmoid", &act.to_string());
        }
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}_load(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it) {{\n  \
             mla_combine_load<kBatch>({load}, it);\n}}\n\
             __device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p, uint32_t& it, int warp) {{\n  \
             mla_combine<kBatch>({args}, it, warp);\n}}",
        );
        self.role(combine, format!("{f}(t, m, p, it, warp);"), Some(format!("{f}_load(t, m, p, it);")));
        Ok(())
    }

    /// KDA decode: a task per range of heads (`t.a[0]..t.a[1]`) of a range
    /// of sequences (`t.a[2]..t.a[3]`); the beta
    /// sigmoid (its prologue) is applied inside.
    pub(super) fn kda(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stage = self.last_stage(op);
        self.place_outputs(op);
        let n = op
            .nodes
            .iter()
            .map(|n| nid(*n))
            .find(|n| matches!(self.op_of(*n), Some((OpKind::KdaDecode, _))))
            .expect("anchor");
        let (_, attrs) = self.op_of(n).expect("an op");
        let ops = g.operands(n);
        let (heads, d) = (attrs.int("heads") as u64, attrs.int("head_dim") as u64);
        // beta: the sigmoid of a value computed elsewhere (the prologue).
        let beta = match self.op_of(ops[4].node) {
            Some((OpKind::Sigmoid, _)) if op.nodes.contains(&ops[4].node.index()) => g.operands(ops[4].node)[0],
            _ => return Err(unsupported(op, "KDA whose beta is not the sigmoid of a projection")),
        };
        let mut ptrs = vec![];
        for v in [ops[0], ops[1], ops[2], ops[3], beta] {
            if op.nodes.contains(&v.node.index()) {
                return Err(unsupported(
                    op,
                    &format!("KDA input {} computed inside the operation", g.node(v.node).name),
                ));
            }
            ptrs.push(self.value(v, op)?);
        }
        let a_log = self.weight(ops[5].node, 0)?;
        let dt_bias = self.weight(ops[6].node, 0)?;
        let st = g.value_type(ops[7]);
        if st.dtype != DType::F32 || st.elements() != heads * d * d {
            return Err(unsupported(op, "a KDA state that is not f32 [heads, d, d]"));
        }
        let state = self.state(ops[7].node, "float");
        let (safe, lower) = match attrs.str("gate") {
            "softplus" => ("false", 0.0),
            "safe" => ("true", attrs.float("lower_bound")),
            other => return Err(internal(op, &format!("KDA gate \"{other}\""))),
        };
        // The gated output norm, where the planner put it here (`head-gate`):
        // each head's output normed and gated before it is written.
        let norm = op
            .nodes
            .iter()
            .map(|m| nid(*m))
            .find(|m| matches!(self.op_of(*m), Some((OpKind::GatedRmsNorm, _))) && g.operands(*m)[0].node == n);
        let (out, gated) = match norm {
            Some(m) => {
                let (_, nattrs) = self.op_of(m).expect("an op");
                let nops = g.operands(m);
                if op.nodes.contains(&nops[1].node.index()) || g.value_type(nops[2]).elements() != d {
                    return Err(unsupported(op, "a gated norm in KDA other than over its heads, gated by a value"));
                }
                let act = match nattrs.str("act") {
                    "sigmoid" => 1,
                    "silu" => 0,
                    a => return Err(unsupported(op, &format!("a gated norm with act \"{a}\""))),
                };
                let gated = [
                    ("gate", self.value(nops[1], op)?),
                    ("norm_w", self.weight(nops[2].node, 0)?),
                    ("norm_eps", float(nattrs.float("eps"))),
                    ("sigmoid_act", act.to_string()),
                ];
                (self.value(ValueRef { node: m, output: 0 }, op)?, Some(gated))
            }
            None => (self.value(ValueRef { node: n, output: 0 }, op)?, None),
        };
        self.header(stage, op, "state update of a range of heads");
        let f = self.fname(op, stage);
        let shape = init!("KdaShape"; heads = heads, d = d, safe_gate = safe, lower_bound = float(lower));
        let mut args = init!("KdaDecode";
            shape = shape,
            h0 = "t.a[0]",
            h1 = "t.a[1]",
            s0 = "t.a[2]",
            s1 = "t.a[3]",
            q = ptrs[0],
            k = ptrs[1],
            v = ptrs[2],
            f = ptrs[3],
            b_logit = ptrs[4],
            a_log = a_log,
            dt_bias = dt_bias,
            state = state,
            out = out,
        );
        for (field, value) in gated.iter().flatten() {
            args = with_field(&args, field, value);
        }
        if self.plan.options.positions == 1 {
            let _ = writeln!(
                self.code,
                "__device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
                 kda_decode<kBatch>({args});\n}}"
            );
            self.role(stage, format!("{f}(t, m, p);"), None);
            return Ok(());
        }
        // A verify step: the positions through the state, logged; the commit
        // steps the state through those each sequence keeps.
        let Some([alpha, k, v, beta]) = self.plan.arena.logs.get(&n.index()).map(Vec::as_slice) else {
            return Err(internal(op, "KDA without its verify-step log"));
        };
        let mut log = vec![];
        for (name, at) in [("alpha_log", alpha), ("k_log", k), ("v_log", v), ("beta_log", beta)] {
            log.push(format!("reinterpret_cast<float*>({})", self.arena(name, Loc::Arena(*at))));
        }
        let log = init!("KdaLog"; alpha = log[0], k = log[1], v = log[2], beta = log[3]);
        let args = with_field(&args, "log", &log);
        let _ = writeln!(
            self.code,
            "__device__ inline auto {f}_args(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
             return {args};\n}}\n\
             __device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
             kda_decode<kBatch, kPositions>({f}_args(t, m, p));\n}}\n\
             // After a verify step: the state stepped through the positions each sequence keeps.\n\
             __device__ inline void {f}_commit(const TaskArgs& t, const Memory& m, const @K@_params& p, \
             const uint32_t* keep) {{\n  \
             kda_commit<kBatch, kPositions>({f}_args(t, m, p), keep);\n}}"
        );
        self.role_commit(stage, format!("{f}(t, m, p);"), None, Some(format!("{f}_commit(t, m, p, keep);")));
        Ok(())
    }

    /// The attention-residual mix (K3): a task per range of token rows
    /// (`t.a[0]..t.a[1]`), the whole row.
    pub(super) fn attn_res(&mut self, op: &FusedOp) -> Result<()> {
        let g = self.g;
        let stage = self.last_stage(op);
        self.place_outputs(op);
        if op.nodes.len() != 1 {
            return Err(unsupported(op, "an attention-residual mix fused with other operations"));
        }
        let n = nid(op.nodes[0]);
        let Some((OpKind::AttnResMix, attrs)) = self.op_of(n) else {
            return Err(unsupported(op, "an attention-residual operation that is not the mix"));
        };
        let ops = g.operands(n);
        let hidden = g.value_type(ops[0]).elements();
        let bt = g.value_type(ops[1]);
        let rows = bt.elements() / hidden.max(1);
        let u = self.value(ops[0], op)?;
        let bank = self.value(ops[1], op)?;
        let (w, gamma) = (self.weight(ops[2].node, 0)?, self.weight(ops[3].node, 0)?);
        let out = self.value(ValueRef { node: n, output: 0 }, op)?;
        let rows = self.param("bank_rows", Param::Int(rows));
        self.header(stage, op, "the mix of the bank and the current row");
        let f = self.fname(op, stage);
        let args = init!("AttnResMix";
            bank = bank,
            rows = format!("uint32_t({rows})"),
            row = u,
            w = w,
            gamma = gamma,
            eps = float(attrs.float("eps")),
            hidden = hidden,
            d0 = 0,
            d1 = hidden,
            b0 = "t.a[0]",
            b1 = "t.a[1]",
            out = out,
        );
        let _ = writeln!(
            self.code,
            "__device__ inline void {f}(const TaskArgs& t, const Memory& m, const @K@_params& p) {{\n  \
             attn_res_mix<kBatch>({args});\n}}"
        );
        self.role(stage, format!("{f}(t, m, p);"), None);
        Ok(())
    }
}

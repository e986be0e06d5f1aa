//! The routed experts on the GPU: stacking and repacking INT4 experts, routing (`noaux_tc`), and the
//! grouped W4A16 MoE kernels.

#[allow(unused_imports)]
use super::*;
use ddtree_kernels::moe_route::op::{MoeLocalizeOp, MoeRouteOp};
use ddtree_kernels::w4a16::MoeBlock;
use ddtree_kernels::{MoeLocalize, MoeLocalizeParams};

/// Scale group of dense routed experts, which [`CudaBackend::load_experts`] quantizes to INT4 for
/// the grouped kernels (the CPU backend's bf16 mode does the same).
pub(crate) const DENSE_EXPERT_GROUP: usize = 32;

/// MoE buffer sets kept for reuse (one per token count and expert shape in flight).
pub(super) const MOE_BUFFER_SETS: usize = 16;

/// Stacks the experts' INT4 (or, quantized here, dense) weights in checkpoint layout:
/// gate_up `[E, 2I, H]` and down `[E, H, I]`.
pub(super) fn stack_experts(experts: &[Ffn<HostLinear>], group_default: usize) -> Result<(PackedInt4, PackedInt4)> {
    let first = experts
        .first()
        .ok_or_else(|| fail("a MoE layer without experts".into()))?;
    let (inter, hidden) = first.gate.shape();
    let group = match &first.gate {
        HostLinear::Int4 { group_size, .. } => *group_size,
        HostLinear::Dense { .. } => group_default,
    };
    let as_int4 = |w: &HostLinear| -> Result<PackedInt4> {
        let (n, k) = w.shape();
        match w {
            HostLinear::Int4 {
                group_size,
                packed,
                scales,
                ..
            } if *group_size == group => Ok(PackedInt4 {
                packed: packed.clone(),
                scales: scales.iter().map(|&s| bf16::from_f32(s)).collect(),
                n,
                k,
                group,
                experts: 1,
            }),
            HostLinear::Int4 { group_size, .. } => {
                Err(fail(format!("experts mix scale groups {group_size} and {group}")))
            }
            HostLinear::Dense { data, .. } => {
                let w: Vec<bf16> = data.iter().map(|&v| bf16::from_f32(v)).collect();
                Ok(quantize(&w, n, k, group, 1))
            }
        }
    };
    let mut up = PackedInt4 {
        packed: Vec::new(),
        scales: Vec::new(),
        n: 2 * inter,
        k: hidden,
        group,
        experts: experts.len(),
    };
    let mut down = PackedInt4 {
        packed: Vec::new(),
        scales: Vec::new(),
        n: hidden,
        k: inter,
        group,
        experts: experts.len(),
    };
    for (e, f) in experts.iter().enumerate() {
        if f.gate.shape() != (inter, hidden) || f.up.shape() != (inter, hidden) || f.down.shape() != (hidden, inter) {
            return Err(fail(format!("expert {e} differs in shape from expert 0")));
        }
        for (w, dst) in [(&f.gate, 0), (&f.up, 0), (&f.down, 1)] {
            let q = as_int4(w)?;
            let dst = if dst == 0 { &mut up } else { &mut down };
            dst.packed.extend_from_slice(&q.packed);
            dst.scales.extend_from_slice(&q.scales);
        }
    }
    Ok((up, down))
}

impl CudaBackend {
    /// The MoE block's kernels for `tokens` tokens of `topk` slots over `ex`: the tuned
    /// variant of [`Lookup::moe_experts`] (path and (gate_up, down) pair), else the hand-chosen
    /// one ([`ddtree_kernels::w4a16::moe::default_variant`]).
    pub(super) fn moe_kernels(&self, tokens: usize, topk: usize, ex: &CudaExperts) -> Result<Arc<MoeKernels>> {
        let lookup = Lookup::moe_experts(tokens, topk, ex.count, ex.hidden, ex.inter, ex.group);
        let v = self.tuned_params::<MoeBlock>(lookup)?;
        if let Some((_, k)) = self.state().moe.iter().find(|(key, _)| *key == v) {
            return Ok(k.clone());
        }
        let k = Arc::new(MoeKernels::for_variant(self.gpu(), &v)?);
        self.state().moe.push((v, k.clone()));
        Ok(k)
    }

    /// [`Backend::load_experts`] on the GPU.
    pub(super) fn load_experts(&self, experts: Vec<Ffn<HostLinear>>) -> Result<CudaExperts> {
        let _span = self.profile.span("load_experts");
        if experts.iter().any(|f| matches!(f.gate, HostLinear::Dense { .. })) {
            tracing::warn!(
                "routed experts are dense in the checkpoint: quantizing them to INT4 g32 for the grouped kernels"
            );
        }
        let (up, down) = stack_experts(&experts, DENSE_EXPERT_GROUP)?;
        weights::supported_int4_group(
            up.group,
            &format!("routed experts [{} x {}, {}]", up.experts, up.n, up.k),
        )?;
        Ok(CudaExperts {
            count: experts.len(),
            inter: up.n / 2,
            hidden: up.k,
            group: up.group,
            w13: self.repack(&up.packed, up.n, up.k, up.experts)?,
            s13: self.upload(&scale_words(&up.scales))?,
            w2: self.repack(&down.packed, down.n, down.k, down.experts)?,
            s2: self.upload(&scale_words(&down.scales))?,
        })
    }

    /// [`Backend::random_experts`] on the GPU.
    pub(super) fn random_experts(
        &self,
        count: usize,
        inter: usize,
        hidden: usize,
        int4_group: Option<usize>,
        seed: u64,
    ) -> Result<CudaExperts> {
        let _span = self.profile.span("random_experts");
        let group = int4_group.unwrap_or(DENSE_EXPERT_GROUP);
        weights::supported_int4_group(group, &format!("routed experts [{count} x {}, {hidden}]", 2 * inter))?;
        let (w13, s13) = self.random_int4(2 * inter, hidden, count, group, seed)?;
        let (w2, s2) = self.random_int4(hidden, inter, count, group, seed ^ 0x5555)?;
        Ok(CudaExperts {
            count,
            inter,
            hidden,
            group,
            w13,
            s13,
            w2,
            s2,
        })
    }

    /// [`Backend::moe_route`] on the GPU.
    pub(super) fn moe_route(&self, logits: &CudaTensor, bias: &CudaVector, cfg: &MoeConfig) -> Result<CudaRouting> {
        let _span = self.profile.span("moe_route");
        let experts = cfg.n_routed_experts;
        if logits.cols != experts || bias.len != experts {
            return Err(fail("moe_route: logits or bias do not match the expert count".into()));
        }
        let (t, topk) = (logits.rows, cfg.num_experts_per_tok);
        let mut ids = self.alloc::<u32>(t * topk)?;
        let mut weights = self.alloc::<f32>(t * topk)?;
        let k = self.first_variant::<MoeRoute>(|_: &MoeRouteParams| true)?;
        MoeRouteOp {
            logits: logits.f32("moe_route")?,
            bias: &bias.f32,
            ids: &mut ids,
            weights: &mut weights,
            tokens: t,
            experts,
            topk,
            n_group: cfg.n_group,
            topk_group: cfg.topk_group,
            norm: cfg.norm_topk_prob,
            scale: cfg.routed_scaling_factor,
        }
        .launch(&k, self.stream())?;
        Ok(CudaRouting {
            tokens: t,
            topk,
            ids,
            weights,
        })
    }

    /// [`Backend::moe_localize`] on the GPU, in place: the experts outside `local` dropped (id
    /// `local.len()`, which the MoE kernels skip, and weight 0: they take a fixed top-k per
    /// token) and the others renumbered from 0. Device-only (no host round trip, no
    /// allocation), so a rank's step can be recorded in a graph.
    pub(super) fn moe_localize(&self, mut routing: CudaRouting, local: std::ops::Range<usize>) -> Result<CudaRouting> {
        let _span = self.profile.span("moe_localize");
        let k = self.first_variant::<MoeLocalize>(|_: &MoeLocalizeParams| true)?;
        MoeLocalizeOp {
            ids: &mut routing.ids,
            weights: &mut routing.weights,
            choices: routing.tokens * routing.topk,
            local,
        }
        .launch(&k, self.stream())?;
        Ok(routing)
    }

    /// [`Backend::moe_experts`] on the GPU.
    pub(super) fn moe_experts(&self, x: &CudaTensor, routing: &CudaRouting, ex: &CudaExperts) -> Result<CudaTensor> {
        let _span = self.profile.span("moe_experts");
        if routing.tokens != x.rows || x.cols != ex.hidden {
            return Err(fail("moe_experts: routing, input and experts disagree in shape".into()));
        }
        let kern = self.moe_kernels(routing.tokens, routing.topk, ex)?;
        let dev = DeviceExperts {
            w13: &ex.w13,
            s13: &ex.s13,
            w2: &ex.w2,
            s2: &ex.s2,
            experts: ex.count as u32,
            hidden: ex.hidden as u32,
            inter: ex.inter as u32,
        };
        let variant = *kern.variant().expect("made by for_variant");
        let key = (routing.tokens, routing.topk, variant, ex.inter);
        let mut st = self.state();
        let at = match st.moe_bufs.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                st.graphs.replaced("MoE buffers");
                if st.moe_bufs.len() >= MOE_BUFFER_SETS {
                    st.moe_bufs.remove(0);
                }
                st.moe_bufs
                    .push((key, kern.buffers(self.stream(), routing.tokens, routing.topk, &dev)?));
                st.moe_bufs.len() - 1
            }
        };
        let bufs = &mut st.moe_bufs[at].1;
        let mut out = self.tensor_bf16(x.rows, x.cols)?;
        let input = MoeInput {
            x: x.bf16("moe_experts")?,
            topk_ids: &routing.ids,
            topk_w: &routing.weights,
            tokens: routing.tokens as u32,
            topk: routing.topk as u32,
        };
        // SAFETY: x [T, H], routing [T, topk], experts stacked in the variants' layout.
        unsafe { kern.run(self.stream(), &dev, &input, out.bf16_mut("moe_experts")?, bufs)? };
        Ok(out)
    }
}

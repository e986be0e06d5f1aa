//! [`RankEngine`]: the server's engine on a model split over several ranks (CPU threads or
//! GPUs), each rank a thread of a [`RankGroup`] that keeps its shard and its drafter.
//!
//! A request runs as one job on every rank (the same generation: the collectives line up).
//! Rank 0 is the rank the server talks to: its token sink hands each round's tokens to the
//! engine thread, which answers whether to go on (the client is still there, no stop string,
//! no shutdown); [`agreed_sink`] broadcasts that decision to every rank, so all ranks stop at
//! the same round boundary and drop their caches. A failure on one rank fails the request
//! (500); if the group cannot be recovered, [`Engine::health`] reports why and the server
//! answers 503.

use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};

use ddtree_engine::parallel::group::{agreed_sink, RankGroup};
use ddtree_engine::{
    generate_plain_with_sink, generate_speculative_with_sink, Backend, Drafter, EngineError, GenerateOptions, Model,
    SpecOptions, TokenSink,
};

use crate::engine::{Engine, Finished, ModelInfo};

/// Makes a rank's drafter for its model (called once per rank at startup, on the rank's thread).
pub type DrafterFactory<B> = Arc<dyn Fn(&Model<B>) -> Result<Box<dyn Drafter<B>>, EngineError> + Send + Sync>;

/// A multi-rank model (with a drafter on every rank, or plain decoding) behind the server.
pub struct RankEngine<B: Backend + 'static> {
    group: RankGroup<B>,
    info: ModelInfo,
    spec: SpecOptions,
}

impl<B: Backend + 'static> RankEngine<B> {
    /// Serves `group`'s model as `id`; with `drafter`, every rank makes its drafter now and
    /// DDTree runs with `spec` (its `tree_source` says which rank builds the trees).
    pub fn new(
        group: RankGroup<B>,
        id: String,
        max_model_len: usize,
        spec: SpecOptions,
        drafter: Option<DrafterFactory<B>>,
    ) -> Result<Self, EngineError> {
        let facts = group.run_local(move |model, local| {
            let name = match &drafter {
                Some(make) => {
                    let d = make(model)?;
                    let name = d.name();
                    *local = Some(Box::new(d));
                    name
                }
                None => {
                    *local = None;
                    "none".to_string()
                }
            };
            let cfg = model.config();
            Ok((
                cfg.vocab_size,
                cfg.max_position_embeddings,
                cfg.eos_token_ids.clone(),
                model.backend().name().to_string(),
                name,
            ))
        })?;
        let (vocab_size, context, eos_ids, device, drafter) = facts.into_iter().next().expect("at least one rank");
        let world = group.world();
        let info = ModelInfo {
            id,
            vocab_size,
            context: max_model_len.min(context),
            eos_ids,
            device: format!("{device} x{world} ranks"),
            drafter,
        };
        Ok(Self { group, info, spec })
    }

    /// The rank group (its health, its world).
    pub fn group(&self) -> &RankGroup<B> {
        &self.group
    }
}

impl<B: Backend + 'static> Engine for RankEngine<B> {
    fn info(&self) -> ModelInfo {
        self.info.clone()
    }

    fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        sink: &mut TokenSink<'_>,
    ) -> Result<Finished, EngineError> {
        // Rank 0 sends each round's tokens here and waits for the decision.
        let (tokens_tx, tokens_rx) = channel::<Vec<u32>>();
        let (decision_tx, decision_rx) = channel::<bool>();
        let link = Mutex::new(Some((tokens_tx, decision_rx)));
        let (prompt, options, spec) = (prompt.to_vec(), options.clone(), self.spec.clone());
        let pending = self.group.submit(move |model, local| {
            let rank0 = model.rank().is_none_or(|c| c.rank == 0);
            let link = if rank0 {
                link.lock().ok().and_then(|mut l| l.take())
            } else {
                None
            };
            let decide = |tokens: &[u32]| match &link {
                Some((tx, rx)) => tx.send(tokens.to_vec()).is_ok() && rx.recv().unwrap_or(false),
                None => true,
            };
            let mut failed = None;
            let mut sink = agreed_sink(model, decide, &mut failed);
            let drafter = local.as_mut().and_then(|l| l.downcast_mut::<Box<dyn Drafter<B>>>());
            let out = match drafter {
                Some(d) => generate_speculative_with_sink(model, d.as_mut(), &prompt, &options, &spec, &mut sink)
                    .map(Finished::speculative),
                None => generate_plain_with_sink(model, &prompt, &options, &mut sink).map(Finished::plain),
            };
            drop(sink);
            match failed {
                Some(e) => Err(e),
                None => out,
            }
        })?;
        // Until rank 0's job ends (and drops its end of the link).
        while let Ok(tokens) = tokens_rx.recv() {
            let _ = decision_tx.send(sink(&tokens));
        }
        let mut outs = pending.wait()?;
        if let Some(r) = outs.iter().position(|o| o.tokens != outs[0].tokens) {
            return Err(EngineError::Comm {
                op: "generate".into(),
                rank: r,
                reason: format!("rank {r} generated other tokens than rank 0 (the ranks diverged)"),
            });
        }
        Ok(outs.swap_remove(0))
    }

    fn health(&self) -> Result<(), String> {
        self.group.health()
    }
}

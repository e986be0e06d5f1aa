//! The tune cache: one human-readable JSON file per device fingerprint, holding for every
//! (kernel, key) the winner, every candidate's timing, and the hash of the candidates' sources
//! the entry is valid for.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{source_hash, Cost, Roofline, Tunable};
use crate::{cache_root, Fingerprint, RuntimeError};

/// Version of the file layout; a file of another version is ignored (and rewritten).
const SCHEMA: u32 = 1;

/// How one candidate fared.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrialStatus {
    /// Checked correct and timed.
    Ok,
    /// Its output did not match the CPU reference: rejected, never chosen.
    Wrong,
    /// It failed to compile, load, check or launch: scored +inf.
    Failed,
}

/// One candidate's measurement at one key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trial {
    /// The variant's symbol.
    pub variant: String,
    /// Median time in µs; `null` (+inf) unless the status is `ok`.
    pub us: Option<f64>,
    /// Outcome.
    pub status: TrialStatus,
    /// What went wrong, for `wrong` and `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl Trial {
    pub(crate) fn failed(variant: String, detail: String) -> Trial {
        Trial {
            variant,
            us: None,
            status: TrialStatus::Failed,
            detail: Some(detail),
        }
    }
}

/// The tuning result of one kernel at one key.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TuneEntry {
    /// Kernel name.
    pub kernel: String,
    /// The bucketed key, as its `Display` form.
    pub key: String,
    /// [`source_hash`] of the candidates when tuned.
    pub source_hash: String,
    /// The winning variant's symbol; `null` when no candidate passed.
    pub winner: Option<String>,
    /// The winner's median µs.
    pub winner_us: Option<f64>,
    /// The default variant (candidate 0).
    pub default: String,
    /// The default's median µs (`null` if it failed or was wrong).
    pub default_us: Option<f64>,
    /// Bytes one launch moves.
    pub bytes: f64,
    /// FLOPs one launch does.
    pub flops: f64,
    /// The winner's achieved GB/s.
    pub gbps: Option<f64>,
    /// The winner's achieved TFLOP/s.
    pub tflops: Option<f64>,
    /// The roofline floor in µs, where the roofline was measured.
    pub floor_us: Option<f64>,
    /// Every candidate, in candidate order.
    pub trials: Vec<Trial>,
}

impl TuneEntry {
    /// Picks the winner among `trials`: the fastest that passed, except that an earlier
    /// candidate within `noise` of it wins the near tie.
    pub(crate) fn new(
        kernel: &str,
        key: String,
        source_hash: String,
        cost: Cost,
        trials: Vec<Trial>,
        noise: f64,
        roofline: Option<Roofline>,
    ) -> TuneEntry {
        let ok = || {
            trials
                .iter()
                .filter_map(|t| t.us.filter(|_| t.status == TrialStatus::Ok).map(|us| (t, us)))
        };
        let best = ok().map(|(_, us)| us).fold(f64::INFINITY, f64::min);
        let winner = ok().find(|(_, us)| *us <= best * (1.0 + noise));
        let winner_us = winner.map(|(_, us)| us);
        TuneEntry {
            kernel: kernel.to_string(),
            key,
            source_hash,
            winner: winner.map(|(t, _)| t.variant.clone()),
            winner_us,
            default: trials.first().map(|t| t.variant.clone()).unwrap_or_default(),
            default_us: trials
                .first()
                .and_then(|t| t.us.filter(|_| t.status == TrialStatus::Ok)),
            bytes: cost.bytes,
            flops: cost.flops,
            gbps: winner_us.map(|us| cost.bytes / us / 1e3),
            tflops: winner_us.map(|us| cost.flops / us / 1e6),
            floor_us: roofline.map(|r| r.floor_us(cost)),
            trials,
        }
    }

    /// The default's time over the winner's (how much tuning gained), when both ran.
    pub fn speedup(&self) -> Option<f64> {
        Some(self.default_us? / self.winner_us?)
    }

    /// The floor as a percentage of the winner's time.
    pub fn percent_of_floor(&self) -> Option<f64> {
        Some(100.0 * self.floor_us? / self.winner_us?)
    }
}

/// The result of looking a key up.
#[derive(Clone, Debug, PartialEq)]
pub enum Lookup<'a, P> {
    /// A valid entry: its winner's params.
    Hit {
        /// The winner's parameters.
        params: P,
        /// The entry.
        entry: &'a TuneEntry,
    },
    /// An entry exists but cannot be used.
    Stale(String),
    /// No entry.
    Miss,
}

#[derive(Debug, Serialize, Deserialize)]
struct TuneFile {
    schema: u32,
    fingerprint: Fingerprint,
    /// Sorted by (kernel, key).
    entries: Vec<TuneEntry>,
}

/// The tune cache of one device fingerprint, in memory, with the file it loads from and saves
/// to. Loading never fails: a missing, unreadable, foreign (another fingerprint) or
/// other-schema file gives an empty cache (reported with `tracing::warn`), rewritten on save.
#[derive(Debug)]
pub struct TuneCache {
    path: PathBuf,
    file: TuneFile,
}

impl TuneCache {
    /// The file for `fingerprint` in `dir`: `<fingerprint id>.json`.
    pub fn file_in(dir: &Path, fingerprint: &Fingerprint) -> PathBuf {
        dir.join(format!("{}.json", fingerprint.id()))
    }

    /// Loads the cache of `fingerprint` from [`cache_root`]`/tune`.
    pub fn open(fingerprint: &Fingerprint) -> TuneCache {
        TuneCache::load(TuneCache::file_in(&cache_root().join("tune"), fingerprint), fingerprint)
    }

    /// Loads the cache at `path`, which must have been made for `fingerprint`.
    pub fn load(path: impl Into<PathBuf>, fingerprint: &Fingerprint) -> TuneCache {
        let path = path.into();
        let empty = || TuneFile {
            schema: SCHEMA,
            fingerprint: fingerprint.clone(),
            entries: Vec::new(),
        };
        let file = match std::fs::read_to_string(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => empty(),
            Err(e) => {
                tracing::warn!("tune cache {} cannot be read ({e}); starting empty", path.display());
                empty()
            }
            Ok(text) => match serde_json::from_str::<TuneFile>(&text) {
                Err(e) => {
                    tracing::warn!(
                        "tune cache {} is corrupt ({e}); starting empty, it will be rewritten",
                        path.display()
                    );
                    empty()
                }
                Ok(f) if f.schema != SCHEMA => {
                    tracing::warn!(
                        "tune cache {} has schema {} (this build reads {SCHEMA}); starting empty",
                        path.display(),
                        f.schema
                    );
                    empty()
                }
                Ok(f) if &f.fingerprint != fingerprint => {
                    tracing::warn!(
                        "tune cache {} was made for {}, not this device ({fingerprint}); ignoring it",
                        path.display(),
                        f.fingerprint
                    );
                    empty()
                }
                Ok(f) => f,
            },
        };
        TuneCache { path, file }
    }

    /// Its file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fingerprint it is for.
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.file.fingerprint
    }

    /// Every entry, sorted by (kernel, key).
    pub fn entries(&self) -> &[TuneEntry] {
        &self.file.entries
    }

    /// The entry of `kernel` at `key` (a bucketed key's `Display` form), valid or not.
    pub fn entry(&self, kernel: &str, key: &str) -> Option<&TuneEntry> {
        self.file.entries.iter().find(|e| e.kernel == kernel && e.key == key)
    }

    /// Adds or replaces an entry.
    pub fn insert(&mut self, entry: TuneEntry) {
        let entries = &mut self.file.entries;
        match entries
            .binary_search_by(|e| (e.kernel.as_str(), e.key.as_str()).cmp(&(entry.kernel.as_str(), entry.key.as_str())))
        {
            Ok(i) => entries[i] = entry,
            Err(i) => entries.insert(i, entry),
        }
    }

    /// The tuned variant of `K` at the bucket of `key`, if a valid entry names one: valid
    /// means the candidates' source hash is unchanged and the winner is still a candidate.
    pub fn lookup<K: Tunable>(&self, key: &K::Key) -> Lookup<'_, K::Params> {
        let key = K::bucket(key);
        let Some(entry) = self.entry(K::NAME, &key.to_string()) else {
            return Lookup::Miss;
        };
        let candidates = K::candidates(&key);
        if entry.source_hash != source_hash::<K>(&candidates) {
            return Lookup::Stale("the kernel's source changed since it was tuned".into());
        }
        let Some(winner) = &entry.winner else {
            return Lookup::Stale("no candidate passed its check when it was tuned".into());
        };
        match candidates.into_iter().find(|p| &K::symbol(p) == winner) {
            Some(params) => Lookup::Hit { params, entry },
            None => Lookup::Stale(format!("the winner `{winner}` is no longer a candidate")),
        }
    }

    /// Writes the file (pretty JSON, atomically).
    pub fn save(&self) -> Result<(), RuntimeError> {
        let mut text = serde_json::to_string_pretty(&self.file).expect("a tune file serializes");
        text.push('\n');
        crate::cache::write_atomic(&self.path, text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(variant: &str, us: Option<f64>, status: TrialStatus) -> Trial {
        Trial {
            variant: variant.into(),
            us,
            status,
            detail: None,
        }
    }

    #[test]
    fn winner_is_the_fastest_correct_with_near_ties_to_the_earlier() {
        let cost = Cost { bytes: 1e6, flops: 0.0 };
        let trials = vec![
            t("a", Some(10.0), TrialStatus::Ok),
            t("b", Some(5.0), TrialStatus::Wrong),
            t("c", None, TrialStatus::Failed),
            t("d", Some(9.9), TrialStatus::Ok),
            t("e", Some(9.0), TrialStatus::Ok),
        ];
        let e = TuneEntry::new("k", "x".into(), "h".into(), cost, trials.clone(), 0.02, None);
        assert_eq!(
            (e.winner.as_deref(), e.winner_us, e.default_us),
            (Some("e"), Some(9.0), Some(10.0))
        );
        assert_eq!(e.gbps, Some(1e6 / 9.0 / 1e3));
        let e = TuneEntry::new("k", "x".into(), "h".into(), cost, trials[..4].to_vec(), 0.02, None);
        assert_eq!(
            e.winner.as_deref(),
            Some("a"),
            "9.9 is within 2% of 10: the default keeps it"
        );
        let e = TuneEntry::new("k", "x".into(), "h".into(), cost, trials[1..3].to_vec(), 0.02, None);
        assert_eq!(
            (e.winner.clone(), e.default_us, e.speedup()),
            (None, None, None),
            "a wrong result is never chosen"
        );
    }
}

//! The hot tier of expert streaming: a pool of expert-sized slots in GPU memory.
//!
//! In streaming mode only the dense weights are uploaded at load. For each MoE layer of a step
//! the router runs on the device as usual; its choices are read back (one small copy, the only
//! host round trip a streamed layer adds), and the host then makes the chosen experts resident
//! group by group: a group is a set of experts that fits in the slots next to the pinned ones.
//! The experts already in GPU memory form the first group, so the experts that must be copied
//! go last and their reads (started for the whole layer at once through
//! [`WeightSource::prefetch`](tarfa_core::weights::WeightSource::prefetch)) overlap with the first
//! group's kernels. Each group's products are computed from the slots (kernels/moe.cu
//! `gate_up_slots`, `down_slots`); once every group has run, `moe_mix` mixes the products in
//! ascending expert id exactly as the resident `down_mix` does. Which experts share a group,
//! which slot one lands in, and what the tier keeps only decide where bytes are, never what is
//! computed from them: a streamed step has the resident step's bits (docs/EXACTNESS.md).
//!
//! A slot holds one expert's gate `[I][H]`, up `[I][H]` and down `[H][I]` BF16 values one after
//! another, as the bundle's extent does, rounded up to 256 bytes. The budget covers the slots:
//! they are the staging buffers too (a copy lands in the slot the kernels read).

use std::collections::{HashMap, HashSet};

use crate::device::{DevBuf, Gpu, PinnedBuf};
use crate::{CudaError, HotOptions, HotStats};
use tarfa_core::config::MoeConfig;
use tarfa_core::weights::ExpertHandle;
use tarfa_stream::CachePolicy;

/// (layer, expert id).
pub(crate) type Key = (usize, usize);

struct Entry {
    key: Key,
    last_use: u64,
    pinned: bool,
}

/// The slots, what each holds, and the counters.
pub(crate) struct HotTier {
    pub pool: DevBuf,
    /// BF16 values from one slot to the next.
    pub slot_elems: usize,
    /// `E` i32 on the device: this launch group's expert -> slot map (-1: not in the group).
    pub slot_of: DevBuf,
    /// Page-locked staging of the maps, one row of `E` i32 per group of a layer (`E + 1` rows):
    /// a row is copied asynchronously and must stay untouched until the copy ran, which the
    /// next layer's read of the router's choices (a stream synchronisation) guarantees.
    pub maps: PinnedBuf,
    /// The next free row of `maps` in this layer.
    pub map_row: usize,
    /// Experts whose copies to the device may still be in flight: their buffers (page-locked
    /// by the warm tier) must live until the stream has passed the copies.
    pub in_flight: Vec<ExpertHandle>,
    slots: Vec<Option<Entry>>,
    index: HashMap<Key, usize>,
    pin_set: HashSet<Key>,
    pin_cap: usize,
    pinned: usize,
    policy: CachePolicy,
    tick: u64,
    pub stats: HotStats,
}

/// BF16 values of one slot: the three matrices, rounded up to 256 bytes.
pub(crate) fn slot_elems(cfg: &MoeConfig) -> usize {
    (crate::min_vram_budget(cfg) / 2) as usize
}

impl HotTier {
    /// Allocates `opts.budget / slot bytes` slots (at most one per expert of the model).
    pub(crate) fn new(
        gpu: &Gpu,
        cfg: &MoeConfig,
        moe_layers: usize,
        opts: &HotOptions,
    ) -> Result<HotTier, CudaError> {
        let slot_elems = slot_elems(cfg);
        let slot_bytes = 2 * slot_elems as u64;
        let wanted = opts.budget / slot_bytes;
        if wanted == 0 {
            return Err(CudaError::VramBudgetTooSmall {
                budget: opts.budget,
                minimum: slot_bytes,
            });
        }
        let all = (moe_layers * cfg.num_experts).max(1) as u64;
        let n = wanted.min(all) as usize;
        let pool = gpu.alloc(n * slot_bytes as usize, "the hot tier (expert slots)")?;
        let e = cfg.num_experts.max(1);
        let slot_of = gpu.alloc(e * 4, "the hot tier's slot map")?;
        let maps = gpu.alloc_pinned((e + 1) * e * 4, "staging of the hot tier's slot maps")?;
        // Pinned entries never leave, so at least one slot must stay free for the rest.
        let pin_cap = match opts.policy {
            CachePolicy::Ledger => n / 2,
            CachePolicy::Static => n * 3 / 4,
            CachePolicy::Lru | CachePolicy::None => 0,
        }
        .min(n - 1);
        Ok(HotTier {
            pool,
            slot_elems,
            slot_of,
            maps,
            map_row: 0,
            in_flight: Vec::new(),
            slots: (0..n).map(|_| None).collect(),
            index: HashMap::new(),
            pin_set: opts.pins.iter().copied().take(pin_cap).collect(),
            pin_cap,
            pinned: 0,
            policy: opts.policy,
            tick: 0,
            stats: HotStats {
                slots: n as u64,
                pool_bytes: n as u64 * slot_bytes,
                ..HotStats::default()
            },
        })
    }

    pub(crate) fn slot_bytes(&self) -> u64 {
        2 * self.slot_elems as u64
    }

    /// The slot holding `key`, if any.
    pub(crate) fn slot(&self, key: Key) -> Option<usize> {
        self.index.get(&key).copied()
    }

    fn is_pinned(&self, key: Key) -> bool {
        self.slot(key)
            .is_some_and(|s| self.slots[s].as_ref().is_some_and(|e| e.pinned))
    }

    /// Groups the sorted, distinct experts `need` of `layer` into launch groups: the experts
    /// held first, then the missing ones; each group fits in the slots next to the pinned
    /// experts outside it. One group when everything fits.
    pub(crate) fn plan(&self, layer: usize, need: &[usize]) -> Vec<Vec<usize>> {
        let (held, missing): (Vec<usize>, Vec<usize>) = need
            .iter()
            .partition(|&&x| self.index.contains_key(&(layer, x)));
        let n = self.slots.len();
        let mut groups = Vec::new();
        let mut cur: Vec<usize> = Vec::new();
        let mut pinned_in = 0;
        // Pinned experts outside a group keep their slots while it runs, and an expert of the
        // pin set becomes pinned when it is placed (while there is room for pins): count the
        // pins as they will be when each group runs.
        let mut pinned = self.pinned;
        for x in held.into_iter().chain(missing) {
            let key = (layer, x);
            let will_pin =
                self.slot(key).is_none() && self.pin_set.contains(&key) && pinned < self.pin_cap;
            let p = usize::from(will_pin || self.is_pinned(key));
            if !cur.is_empty()
                && cur.len() + 1 + (pinned + usize::from(will_pin) - pinned_in - p) > n
            {
                groups.push(std::mem::take(&mut cur));
                pinned_in = 0;
            }
            cur.push(x);
            pinned_in += p;
            pinned += usize::from(will_pin);
        }
        if !cur.is_empty() {
            groups.push(cur);
        }
        groups
    }

    /// Marks `key` used now (a hit).
    pub(crate) fn touch(&mut self, key: Key) {
        self.tick += 1;
        if let Some(s) = self.slot(key) {
            if let Some(e) = self.slots[s].as_mut() {
                e.last_use = self.tick;
            }
        }
    }

    /// A slot for `key`, which is not held, that no expert of `group` (of the same layer)
    /// occupies: a free one, else the least recently used unpinned one outside the group.
    pub(crate) fn place(&mut self, key: Key, group: &[usize]) -> Result<usize, CudaError> {
        debug_assert!(self.slot(key).is_none());
        let slot = match self.slots.iter().position(|s| s.is_none()) {
            Some(s) => s,
            None => {
                let victim = self
                    .slots
                    .iter()
                    .enumerate()
                    .filter_map(|(s, e)| e.as_ref().map(|e| (s, e)))
                    .filter(|(_, e)| {
                        let in_group = e.key.0 == key.0 && group.contains(&e.key.1);
                        !e.pinned && !in_group
                    })
                    .min_by_key(|(_, e)| e.last_use)
                    .map(|(s, _)| s);
                let Some(s) = victim else {
                    // plan() sizes groups so that this cannot happen
                    return Err(CudaError::Internal(format!(
                        "the hot tier has no slot for expert {} of layer {} ({} slots)",
                        key.1,
                        key.0,
                        self.slots.len()
                    )));
                };
                let old = self.slots[s].take().map(|e| e.key);
                if let Some(old) = old {
                    self.index.remove(&old);
                }
                self.stats.evictions += 1;
                s
            }
        };
        self.tick += 1;
        let pinned = self.pin_set.contains(&key) && self.pinned < self.pin_cap;
        self.pinned += usize::from(pinned);
        self.slots[slot] = Some(Entry {
            key,
            last_use: self.tick,
            pinned,
        });
        self.index.insert(key, slot);
        Ok(slot)
    }

    /// Drops `key` from its slot (its copy failed: the slot's bytes are not that expert's).
    pub(crate) fn forget(&mut self, key: Key) {
        if let Some(s) = self.index.remove(&key) {
            if let Some(e) = self.slots[s].take() {
                self.pinned -= usize::from(e.pinned);
            }
        }
    }

    /// After a layer: `Static` and `None` keep nothing but the pinned experts.
    pub(crate) fn end_layer(&mut self) {
        if matches!(self.policy, CachePolicy::Static | CachePolicy::None) {
            for s in self.slots.iter_mut() {
                if s.as_ref().is_some_and(|e| !e.pinned) {
                    if let Some(e) = s.take() {
                        self.index.remove(&e.key);
                    }
                }
            }
        }
    }
}

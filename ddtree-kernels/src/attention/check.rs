//! Kernel-versus-reference checks of the attention kernels on a [`Target`]: fresh random inputs,
//! outputs poisoned with NaN before the launch, bf16 tolerance, ragged dims (latent widths that
//! are not multiples of 32, several passes over wide latents or heads, masks of several words).

use ddtree_codegen::Kernel;
use half::bf16;
use rand::rngs::StdRng;
use rand::Rng;

use super::{
    gqa, mla, mla_absorb, GqaAttention, GqaParams, MlaAbsorbOutput, MlaAbsorbQuery, MlaAppendParams, MlaAttention,
    MlaAttnParams, MlaKvAppend, MlaOutputParams, MlaQueryParams,
};
use crate::check::{poisoned_bf16, random_bf16, result, Arg, CheckError, CheckResult, Sizes, Target, Tolerance};
use crate::tree::check::random_mask;

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// RoPE `cos` / `sin` tables `[max_pos, half]` for `2 * half` rotated dims (theta 10000).
pub fn rope_tables(max_pos: usize, half: usize) -> (Vec<f32>, Vec<f32>) {
    let angles: Vec<f32> = (0..max_pos * half)
        .map(|i| (i / half) as f32 * 10000f32.powf(-((i % half) as f32) / half as f32))
        .collect();
    (
        angles.iter().map(|a| a.cos()).collect(),
        angles.iter().map(|a| a.sin()).collect(),
    )
}

/// Checks the latent-cache append: `rows` rows written at `row0` of a cache with two spare rows
/// after them; every other cache row must stay poisoned.
pub fn kv_append(
    t: &Target<'_>,
    p: &MlaAppendParams,
    rows: usize,
    lora: usize,
    rope: usize,
    row0: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (w, half, max_pos) = (lora + rope, rope / 2, 4096usize);
    let (kv, kvf) = random_bf16(rng, rows * w, -2.0, 2.0);
    let (g, gf) = random_bf16(rng, lora, 0.5, 1.5);
    let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..max_pos as u32)).collect();
    let (cos, sin) = rope_tables(max_pos, half.max(1));
    let capacity = row0 + rows + 2;
    let eps = 1e-6f32;
    let (dkv, dg, dp) = (t.upload(&kv)?, t.upload(&g)?, t.upload(&positions)?);
    let (dc, ds) = (t.upload(&cos)?, t.upload(&sin)?);
    let mut cache = poisoned_bf16(t, capacity * w)?;
    let lens = t.upload(&[row0 as u32])?;
    let mut args = [
        Arg::In(&dkv),
        Arg::In(&dg),
        Arg::In(&dp),
        Arg::In(&dc),
        Arg::In(&ds),
        Arg::Out(&mut cache),
        Arg::In(&lens),
        Arg::from(rows as u32),
        Arg::from(lora as u32),
        Arg::from(rope as u32),
        Arg::from(eps),
    ];
    // SAFETY: kv_a holds rows * w values, the cache (row0 + rows + 2) * w, the tables
    // max_pos * rope / 2 with every position below max_pos.
    unsafe { t.launch::<MlaKvAppend>(p, rows as u32, &mut args)? };
    let got = to_f32(&t.download(&cache)?);
    let written = mla::append_reference(&kvf, &gf, &positions, &cos, &sin, lora, rope, eps);
    // Rows outside [row0, row0 + rows) must keep their poison: compare them as "NaN -> 0".
    let mut want = vec![0f32; capacity * w];
    want[row0 * w..(row0 + rows) * w].copy_from_slice(&written);
    let got: Vec<f32> = got
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let inside = (row0 * w..(row0 + rows) * w).contains(&i);
            match (inside, v.is_nan()) {
                (true, _) => v,
                (false, true) => 0.0,
                (false, false) => f32::NAN,
            }
        })
        .collect();
    let case = format!("rows={rows} lora={lora} rope={rope} row0={row0}");
    Ok(result::<MlaKvAppend>(p, case, &got, &want, Tolerance::BF16))
}

/// Checks MLA attention over `prefix` cached rows plus `nodes` new rows under a random tree mask
/// (or a causal chain). With `prefix == 0` the last node's mask row is cleared: it sees no key
/// and must get zeros.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    t: &Target<'_>,
    p: &MlaAttnParams,
    prefix: usize,
    nodes: usize,
    heads: usize,
    lora: usize,
    rope: usize,
    chain: bool,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let w = lora + rope;
    let rows = nodes * heads;
    let (q, qf) = random_bf16(rng, rows * w, -1.0, 1.0);
    let (c, cf) = random_bf16(rng, (prefix + nodes) * w, -1.0, 1.0);
    let (mut mask, words) = random_mask(rng, nodes, chain);
    if prefix == 0 {
        mask[(nodes - 1) * words..nodes * words].fill(0);
    }
    let scale = 2.0 / (w as f32).sqrt();
    let (dq, dc, dm) = (t.upload(&q)?, t.upload(&c)?, t.upload(&mask)?);
    let mut out = poisoned_bf16(t, rows * lora)?;
    let lens = t.upload(&[prefix as u32])?;
    let mut args = [
        Arg::In(&dq),
        Arg::In(&dc),
        Arg::In(&dm),
        Arg::Out(&mut out),
        Arg::In(&lens),
        Arg::from(heads as u32),
        Arg::from(nodes as u32),
        Arg::from(words as u32),
        Arg::from(lora as u32),
        Arg::from(rope as u32),
        Arg::from(scale),
    ];
    // SAFETY: q holds nodes * heads * w values, the cache (prefix + nodes) * w, the mask
    // nodes * words, out nodes * heads * lora.
    unsafe { t.launch::<MlaAttention>(p, rows as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let want = mla::attention_reference(&qf, &cf, &mask, heads, prefix, nodes, words, lora, rope, scale);
    let case = format!(
        "prefix={prefix} nodes={nodes} heads={heads} lora={lora} rope={rope} {}",
        if chain { "chain" } else { "tree" }
    );
    Ok(result::<MlaAttention>(p, case, &got, &want, Tolerance::BF16))
}

/// Every candidate of [`MlaKvAppend`] at the sizes of `sizes`.
pub fn kv_append_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in MlaKvAppend::space() {
        // (rows, lora, rope, row0): the tiny model, Kimi, and ragged widths.
        let mut cases = vec![
            (1, 32, 16, 0),
            (5, 32, 16, 7),
            (3, 512, 64, 2),
            (2, 100, 6, 1),
            (2, 300, 2, 0),
            (2, 1024, 64, 3),
        ];
        if sizes == Sizes::Full {
            cases.extend([(64, 512, 64, 1000), (200, 512, 64, 0), (33, 32, 16, 4000)]);
        }
        for (rows, lora, rope, row0) in cases {
            if p.vec && (lora % 8 != 0 || rope % 8 != 0) {
                continue;
            }
            out.push(kv_append(t, &p, rows, lora, rope, row0, rng)?);
        }
    }
    Ok(out)
}

/// Every candidate of [`MlaAttention`] at the sizes of `sizes`.
pub fn mla_attention_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in MlaAttention::space() {
        // (prefix, nodes, heads, lora, rope, chain): the tiny model, Kimi's 512 + 64, masks of
        // two words, a latent of two passes (600), and rows wider than the shared q (1000 + 64).
        let mut cases = vec![
            (0, 5, 2, 32, 16, false),
            (37, 9, 3, 32, 16, false),
            (20, 4, 2, 512, 64, false),
            (6, 40, 1, 32, 16, false),
            (5, 3, 1, 600, 40, true),
            (3, 2, 1, 1000, 64, false),
        ];
        if sizes == Sizes::Full {
            cases.extend([
                (4096, 16, 8, 512, 64, false),
                (32768, 4, 2, 512, 64, true),
                (1000, 64, 4, 32, 16, false),
                (300, 70, 3, 40, 8, false),
            ]);
        }
        for (prefix, nodes, heads, lora, rope, chain) in cases {
            out.push(mla_attention(t, &p, prefix, nodes, heads, lora, rope, chain, rng)?);
        }
    }
    Ok(out)
}

/// Checks grouped-query attention: `rows` query rows against `keys` keys.
#[allow(clippy::too_many_arguments)]
pub fn gqa_attention(
    t: &Target<'_>,
    p: &GqaParams,
    rows: usize,
    keys: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (q, qf) = random_bf16(rng, rows * heads * head_dim, -1.0, 1.0);
    let (k, kf) = random_bf16(rng, keys * kv_heads * head_dim, -1.0, 1.0);
    let (v, vf) = random_bf16(rng, keys * kv_heads * head_dim, -1.0, 1.0);
    let scale = 2.0 / (head_dim as f32).sqrt();
    let (dq, dk, dv) = (t.upload(&q)?, t.upload(&k)?, t.upload(&v)?);
    let mut out = poisoned_bf16(t, rows * heads * head_dim)?;
    let mut args = [
        Arg::In(&dq),
        Arg::In(&dk),
        Arg::In(&dv),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(keys as u32),
        Arg::from(heads as u32),
        Arg::from(kv_heads as u32),
        Arg::from(head_dim as u32),
        Arg::from(scale),
    ];
    // SAFETY: q and out hold rows * heads * head_dim values, k and v keys * kv_heads * head_dim;
    // heads is a multiple of kv_heads.
    unsafe { t.launch::<GqaAttention>(p, (rows * heads) as u32, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let want = gqa::reference(&qf, &kf, &vf, rows, keys, heads, kv_heads, head_dim, scale);
    let case = format!("rows={rows} keys={keys} heads={heads} kv_heads={kv_heads} head_dim={head_dim}");
    Ok(result::<GqaAttention>(p, case, &got, &want, Tolerance::BF16))
}

/// Every candidate of [`GqaAttention`] at the sizes of `sizes`.
pub fn gqa_attention_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in GqaAttention::space() {
        // (rows, keys, heads, kv_heads, head_dim): groups of 2, 1 (MHA) and all heads (MQA),
        // a ragged head dim of two passes (200), one of several passes wider than the shared q.
        let mut cases = vec![
            (3, 17, 4, 2, 64),
            (2, 40, 2, 2, 128),
            (1, 5, 3, 1, 200),
            (2, 1, 4, 1, 16),
            (1, 3, 2, 1, 600),
        ];
        if sizes == Sizes::Full {
            cases.extend([(16, 4096, 32, 8, 128), (16, 200, 16, 4, 128), (7, 33000, 8, 2, 64)]);
        }
        for (rows, keys, heads, kv_heads, head_dim) in cases {
            out.push(gqa_attention(t, &p, rows, keys, heads, kv_heads, head_dim, rng)?);
        }
    }
    Ok(out)
}

/// Checks [`MlaAbsorbQuery`] on `rows` tokens of `heads` heads with latent width `lora` and `v`
/// value dims per head (only the head stride of `kv_b` depends on it): `q`, `kv_b` and positions
/// random, the output poisoned. Bf16 tolerance with the absolute part scaled by the output's RMS
/// (sums of `nope` products cancel).
pub fn mla_absorb_query(
    t: &Target<'_>,
    p: &MlaQueryParams,
    rows: usize,
    heads: usize,
    lora: usize,
    v: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let (nope, rope) = (p.nope as usize, p.rope as usize);
    let (half, max_pos) = (rope / 2, 4096usize);
    let (q, qf) = random_bf16(rng, rows * heads * (nope + rope), -1.0, 1.0);
    let (w, wf) = random_bf16(rng, heads * (nope + v) * lora, -1.0, 1.0);
    let positions: Vec<u32> = (0..rows).map(|_| rng.random_range(0..max_pos as u32)).collect();
    let (cos, sin) = rope_tables(max_pos, half);
    let (dq, dw, dp) = (t.upload(&q)?, t.upload(&w)?, t.upload(&positions)?);
    let (dc, ds) = (t.upload(&cos)?, t.upload(&sin)?);
    let mut out = poisoned_bf16(t, rows * heads * (lora + rope))?;
    let mut args = [
        Arg::In(&dq),
        Arg::In(&dw),
        Arg::In(&dp),
        Arg::In(&dc),
        Arg::In(&ds),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(heads as u32),
        Arg::from(lora as u32),
        Arg::from(((nope + v) * lora) as u32),
    ];
    let grid = mla_absorb::query_grid(p, heads as u32, lora as u32);
    // SAFETY: q [rows, heads, nope + rope], kv_b [heads * (nope + v), lora] with lora % cols ==
    // 0 (the suite's cases), out [rows, heads, lora + rope], positions below max_pos.
    unsafe { t.launch::<MlaAbsorbQuery>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let want = mla_absorb::query_reference(
        &qf,
        &wf,
        &positions,
        &cos,
        &sin,
        heads,
        (nope, rope, v, lora),
        p.interleave,
    );
    let tol = Tolerance::bf16_sums(&want);
    let case = format!("rows={rows} heads={heads} lora={lora} v={v}");
    Ok(result::<MlaAbsorbQuery>(p, case, &got, &want, tol))
}

/// Every candidate of [`MlaAbsorbQuery`]: one token and several (the decode step and small
/// trees), one head and several, the candidate's smallest latent and a wider one; the full
/// sizes add Kimi's 64 heads at 1, 4 and 16 tokens.
pub fn mla_absorb_query_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in MlaAbsorbQuery::space() {
        let c = p.cols as usize;
        let mut cases = vec![(1, 1, c, 8), (3, 2, 2 * c, 16)];
        if sizes == Sizes::Full {
            cases.extend([
                (1, 64, 512, 128),
                (4, 64, 512, 128),
                (16, 64, 512, 128),
                (17, 8, 512, 128),
            ]);
        }
        for (rows, heads, lora, v) in cases {
            out.push(mla_absorb_query(t, &p, rows, heads, lora, v, rng)?);
        }
    }
    Ok(out)
}

/// Checks [`MlaAbsorbOutput`] on `rows` tokens of `heads` heads (`nope` and `v` dims per head,
/// the candidate's `lora`), output poisoned; tolerance as [`mla_absorb_query`].
pub fn mla_absorb_output(
    t: &Target<'_>,
    p: &MlaOutputParams,
    rows: usize,
    heads: usize,
    nope: usize,
    v: usize,
    rng: &mut StdRng,
) -> Result<CheckResult, CheckError> {
    let lora = p.lora as usize;
    let (a, af) = random_bf16(rng, rows * heads * lora, -1.0, 1.0);
    let (w, wf) = random_bf16(rng, heads * (nope + v) * lora, -1.0, 1.0);
    let (da, dw) = (t.upload(&a)?, t.upload(&w)?);
    let mut out = poisoned_bf16(t, rows * heads * v)?;
    let mut args = [
        Arg::In(&da),
        Arg::In(&dw),
        Arg::Out(&mut out),
        Arg::from(rows as u32),
        Arg::from(heads as u32),
        Arg::from(nope as u32),
        Arg::from(v as u32),
        Arg::from(((nope + v) * lora) as u32),
    ];
    let grid = mla_absorb::output_grid(p, heads as u32, v as u32);
    // SAFETY: o_lat [rows, heads, lora], kv_b [heads * (nope + v), lora], out [rows, heads * v];
    // v % cols == 0 (the suite's cases).
    unsafe { t.launch::<MlaAbsorbOutput>(p, grid, &mut args)? };
    let got = to_f32(&t.download(&out)?);
    let want = mla_absorb::output_reference(&af, &wf, rows, heads, (nope, v, lora));
    let tol = Tolerance::bf16_sums(&want);
    let case = format!("rows={rows} heads={heads} nope={nope} v={v}");
    Ok(result::<MlaAbsorbOutput>(p, case, &got, &want, tol))
}

/// Every candidate of [`MlaAbsorbOutput`]: one and several tokens, a head count that leaves the
/// last block partly idle; the full sizes add Kimi's 64 heads (nope 128, v 128) at 1, 4 and 16
/// tokens.
pub fn mla_absorb_output_suite(t: &Target<'_>, sizes: Sizes, rng: &mut StdRng) -> Result<Vec<CheckResult>, CheckError> {
    let mut out = Vec::new();
    for p in MlaAbsorbOutput::space() {
        let c = p.cols as usize;
        let mut cases = vec![(1, 1, 8, c), (3, 3, 16, 2 * c)];
        if sizes == Sizes::Full {
            cases.extend([
                (1, 64, 128, 128),
                (4, 64, 128, 128),
                (16, 64, 128, 128),
                (5, 7, 128, 128),
            ]);
        }
        for (rows, heads, nope, v) in cases {
            out.push(mla_absorb_output(t, &p, rows, heads, nope, v, rng)?);
        }
    }
    Ok(out)
}

//! Portable versions of the two inner loops.

/// `out[t] = q · keys[t] · scale` for the keys (rows of `q.len()`) in `keys`.
pub(super) fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
        *o = super::dot(q, k) * scale;
    }
}

/// `out += Σ_t p[t] · values[t]`.
pub(super) fn accumulate(p: &[f32], values: &[f32], out: &mut [f32]) {
    for (&p, v) in p.iter().zip(values.chunks_exact(out.len())) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += p * x;
        }
    }
}

/// [`scores`] for each head of `qs` (heads of `keys`' row size, back to back) against the `n`
/// rows of `keys`: head `h`'s scores at `out[h·stride..][..n]`.
pub(super) fn scores_heads(
    qs: &[f32],
    keys: &[f32],
    scale: f32,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    let hd = keys.len() / n.max(1);
    if hd == 0 {
        return;
    }
    for (h, q) in qs.chunks_exact(hd).enumerate() {
        scores(q, keys, scale, &mut out[h * stride..][..n]);
    }
}

/// [`accumulate`] for each head of `outs` (heads of `values`' row size, back to back), head
/// `h` weighting the `n` rows of `values` by `scores[h·stride..][..n]`.
pub(super) fn accumulate_heads(
    scores: &[f32],
    stride: usize,
    n: usize,
    values: &[f32],
    outs: &mut [f32],
) {
    let hd = values.len() / n.max(1);
    if hd == 0 {
        return;
    }
    for (h, o) in outs.chunks_exact_mut(hd).enumerate() {
        accumulate(&scores[h * stride..][..n], values, o);
    }
}

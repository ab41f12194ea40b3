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

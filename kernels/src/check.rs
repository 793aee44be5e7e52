//! The operand checks every backend makes before computing, in one place: a wrong shape is
//! refused with the same words whichever backend refused it, and a backend cannot forget one.

use crate::backend::{AttentionShape, Trans};
use crate::error::shape_err;
use crate::{Element, Result, Tensor};

/// `values` host values for the elements of `t` (`write`).
pub(crate) fn write(values: usize, t: &Tensor) -> Result<()> {
    if values != t.len() {
        return Err(shape_err(
            "write",
            format!("{values} values for a tensor of {:?}", t.shape()),
        ));
    }
    Ok(())
}

/// Two operands of one elementwise operation, named `names` in the message.
pub(crate) fn same_len(
    op: &'static str,
    (a, b): (&Tensor, &Tensor),
    names: (&str, &str),
) -> Result<()> {
    if a.len() != b.len() {
        return Err(shape_err(
            op,
            format!(
                "{} {:?} and {} {:?}",
                names.0,
                a.shape(),
                names.1,
                b.shape()
            ),
        ));
    }
    Ok(())
}

/// The rows and columns of `op(t)`: `t` as stored, or transposed.
pub(crate) fn operand_dims(t: &Tensor, tr: Trans) -> (usize, usize) {
    match tr {
        Trans::No => (t.rows(), t.cols()),
        Trans::Yes => (t.cols(), t.rows()),
    }
}

/// The product's `(m, k, n)`: `op(a)` is `m x k`, `op(b)` is `k x n`; with `accumulate`, `c`
/// must already be `m x n`.
pub(crate) fn matmul(
    (a, ta): (&Tensor, Trans),
    (b, tb): (&Tensor, Trans),
    c: &Tensor,
    accumulate: bool,
) -> Result<(usize, usize, usize)> {
    let ((m, k), (k2, n)) = (operand_dims(a, ta), operand_dims(b, tb));
    if k != k2 {
        return Err(shape_err(
            "matmul",
            format!(
                "op(a) is {m}x{k} ({:?}, {ta:?}) but op(b) is {k2}x{n} ({:?}, {tb:?})",
                a.shape(),
                b.shape()
            ),
        ));
    }
    if accumulate && (c.rows() != m || c.cols() != n || c.len() != m * n) {
        return Err(shape_err(
            "matmul",
            format!("accumulating into {:?}, product is {m}x{n}", c.shape()),
        ));
    }
    Ok((m, k, n))
}

/// A bias for every row of `y`.
pub(crate) fn bias(y: &Tensor, bias: &Tensor) -> Result<()> {
    let n = y.cols();
    if bias.len() != n {
        return Err(shape_err(
            "add_bias",
            format!("bias has {} elements, rows have {n}", bias.len()),
        ));
    }
    Ok(())
}

/// Column sums of `x` accumulated into `out`.
pub(crate) fn sum_rows_into(x: &Tensor, out: &Tensor) -> Result<()> {
    let n = x.cols();
    if out.len() != n {
        return Err(shape_err(
            "sum_rows",
            format!("accumulating into {} elements, rows have {n}", out.len()),
        ));
    }
    Ok(())
}

/// An activation's input and the gradient of its output.
pub(crate) fn activation_backward(x: &Tensor, dy: &Tensor) -> Result<()> {
    if x.len() != dy.len() {
        return Err(shape_err(
            "activation_backward",
            format!("input {:?} but gradient {:?}", x.shape(), dy.shape()),
        ));
    }
    Ok(())
}

/// LayerNorm's parameters for the rows of `x`.
pub(crate) fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<()> {
    let n = x.cols();
    if gamma.len() != n || beta.len() != n {
        return Err(shape_err(
            "layer_norm",
            format!(
                "rows have {n} features, gamma {} and beta {}",
                gamma.len(),
                beta.len()
            ),
        ));
    }
    Ok(())
}

/// LayerNorm's input gradient operands.
pub(crate) fn layer_norm_backward_input(
    x: &Tensor,
    gamma: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    dy: &Tensor,
) -> Result<()> {
    let rows = x.rows();
    if gamma.len() != x.cols() || dy.len() != x.len() || mean.len() != rows || rstd.len() != rows {
        return Err(shape_err(
            "layer_norm_backward_input",
            format!(
                "x {:?}, dy {:?}, gamma {}",
                x.shape(),
                dy.shape(),
                gamma.len()
            ),
        ));
    }
    Ok(())
}

/// LayerNorm's parameter gradient operands; with `accumulate`, the accumulators too.
pub(crate) fn layer_norm_backward_params(
    x: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    dy: &Tensor,
    (dgamma, dbeta): (&Tensor, &Tensor),
    accumulate: bool,
) -> Result<()> {
    let (n, rows) = (x.cols(), x.rows());
    if dy.len() != x.len() || mean.len() != rows || rstd.len() != rows {
        return Err(shape_err(
            "layer_norm_backward_params",
            format!("x {:?}, dy {:?}", x.shape(), dy.shape()),
        ));
    }
    if accumulate && (dgamma.len() != n || dbeta.len() != n) {
        return Err(shape_err(
            "layer_norm_backward_params",
            format!(
                "accumulators have {} and {}, rows {n}",
                dgamma.len(),
                dbeta.len()
            ),
        ));
    }
    Ok(())
}

/// One label per row of the logits.
pub(crate) fn label_count<E: Element>(logits: &Tensor, labels: &Tensor<E>) -> Result<()> {
    let rows = logits.rows();
    if labels.len() != rows {
        return Err(shape_err(
            "softmax_cross_entropy",
            format!("{rows} rows of logits but {} labels", labels.len()),
        ));
    }
    Ok(())
}

/// One gradient row of `width` per id.
pub(crate) fn embedding_backward(ids: &Tensor, dy: &Tensor, width: usize) -> Result<()> {
    if dy.len() != ids.len() * width {
        return Err(shape_err(
            "embedding backward",
            format!("{} ids but gradient {:?}", ids.len(), dy.shape()),
        ));
    }
    Ok(())
}

/// Attention's backward operands against `shape`.
pub(crate) fn attention_backward(
    qkv: &Tensor,
    (out, lse, dout): (&Tensor, &Tensor, &Tensor),
    shape: AttentionShape,
) -> Result<()> {
    crate::sequence::check("attention backward", shape, qkv.len())?;
    let rows = shape.batch * shape.seq;
    let c = shape.width;
    if out.len() != rows * c
        || dout.len() != rows * c
        || lse.len() != shape.batch * shape.heads * shape.seq
    {
        return Err(shape_err(
            "attention backward",
            format!(
                "output {:?}, its gradient {:?} and log-sum-exp {:?} do not fit {shape:?}",
                out.shape(),
                dout.shape(),
                lse.shape()
            ),
        ));
    }
    Ok(())
}

/// An SGD update's operands: the gradient, and the momentum buffer when momentum is on.
pub(crate) fn sgd(
    param: &Tensor,
    grad: &Tensor,
    buf: Option<&Tensor>,
    momentum: f32,
) -> Result<()> {
    if param.len() != grad.len() {
        return Err(shape_err(
            "sgd_update",
            format!("param {:?}, grad {:?}", param.shape(), grad.shape()),
        ));
    }
    match buf {
        Some(b) if momentum != 0.0 && b.len() != param.len() => {
            Err(shape_err("sgd_update", "momentum buffer length differs"))
        }
        None if momentum != 0.0 => Err(shape_err("sgd_update", "momentum needs a buffer")),
        _ => Ok(()),
    }
}

/// An Adam update's operands.
pub(crate) fn lion(param: &Tensor, grad: &Tensor, m: &Tensor) -> Result<()> {
    let n = param.len();
    if grad.len() != n || m.len() != n {
        return Err(shape_err(
            "lion_update",
            format!("param {:?}, grad {:?}", param.shape(), grad.shape()),
        ));
    }
    Ok(())
}

/// A delay compensation's operands.
pub(crate) fn delay_compensation(
    grad: &Tensor,
    current: &Tensor,
    stale: &Tensor,
    mean_square: Option<&Tensor>,
    adaptive: bool,
) -> Result<()> {
    let n = grad.len();
    if current.len() != n || stale.len() != n {
        return Err(shape_err(
            "delay_compensate",
            format!(
                "grad {:?}, weights {:?}, stale weights {:?}",
                grad.shape(),
                current.shape(),
                stale.shape()
            ),
        ));
    }
    match mean_square {
        Some(ms) if adaptive && ms.len() != n => Err(shape_err(
            "delay_compensate",
            "mean-square buffer length differs",
        )),
        None if adaptive => Err(shape_err(
            "delay_compensate",
            "the adaptive form needs its mean-square buffer",
        )),
        _ => Ok(()),
    }
}

/// Operand lengths of an Adam update.
pub(crate) fn adam(param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor) -> Result<()> {
    let n = param.len();
    if grad.len() != n || m.len() != n || v.len() != n {
        return Err(shape_err(
            "adam_update",
            format!("param {:?}, grad {:?}", param.shape(), grad.shape()),
        ));
    }
    Ok(())
}

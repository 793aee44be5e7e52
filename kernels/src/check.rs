//! The operand checks every backend makes before computing, in one place: a wrong shape is
//! refused with the same words whichever backend refused it, and a backend cannot forget one.

use crate::backend::{AttentionShape, Trans};
use crate::error::shape_err;
use crate::{Element, Result, Tensor};

/// `Ok` when the operands `fit`, else `op`'s shape error with the detail `detail` writes (only
/// then).
fn ensure(fit: bool, op: &'static str, detail: impl FnOnce() -> String) -> Result<()> {
    if fit {
        Ok(())
    } else {
        Err(shape_err(op, detail()))
    }
}

/// `values` host values for the elements of `t` (`write`).
pub(crate) fn write(values: usize, t: &Tensor) -> Result<()> {
    ensure(values == t.len(), "write", || {
        format!("{values} values for a tensor of {:?}", t.shape())
    })
}

/// Two operands of one elementwise operation, named `names` in the message.
pub(crate) fn same_len(
    op: &'static str,
    (a, b): (&Tensor, &Tensor),
    names: (&str, &str),
) -> Result<()> {
    ensure(a.len() == b.len(), op, || {
        format!(
            "{} {:?} and {} {:?}",
            names.0,
            a.shape(),
            names.1,
            b.shape()
        )
    })
}

/// The product's `(m, k, n)`: `op(a)` is `m x k`, `op(b)` is `k x n`; with `accumulate`, `c`
/// must already be `m x n`.
pub(crate) fn matmul(
    (a, ta): (&Tensor, Trans),
    (b, tb): (&Tensor, Trans),
    c: &Tensor,
    accumulate: bool,
) -> Result<(usize, usize, usize)> {
    let ((m, k), (k2, n)) = (ta.dims(a), tb.dims(b));
    ensure(k == k2, "matmul", || {
        format!(
            "op(a) is {m}x{k} ({:?}, {ta:?}) but op(b) is {k2}x{n} ({:?}, {tb:?})",
            a.shape(),
            b.shape()
        )
    })?;
    ensure(
        !accumulate || (c.rows() == m && c.cols() == n && c.len() == m * n),
        "matmul",
        || format!("accumulating into {:?}, product is {m}x{n}", c.shape()),
    )?;
    Ok((m, k, n))
}

/// A vector `v` of one element per column of `x` for `op`, described in its message as
/// `what` followed by its length.
fn row_width(op: &'static str, x: &Tensor, v: &Tensor, what: &str) -> Result<()> {
    let n = x.cols();
    ensure(v.len() == n, op, || {
        format!("{what} {} elements, rows have {n}", v.len())
    })
}

/// A bias for every row of `y`.
pub(crate) fn bias(y: &Tensor, bias: &Tensor) -> Result<()> {
    row_width("add_bias", y, bias, "bias has")
}

/// Column sums of `x` accumulated into `out`.
pub(crate) fn sum_rows_into(x: &Tensor, out: &Tensor) -> Result<()> {
    row_width("sum_rows", x, out, "accumulating into")
}

/// An activation's input and the gradient of its output.
pub(crate) fn activation_backward(x: &Tensor, dy: &Tensor) -> Result<()> {
    ensure(x.len() == dy.len(), "activation_backward", || {
        format!("input {:?} but gradient {:?}", x.shape(), dy.shape())
    })
}

/// LayerNorm's parameters for the rows of `x`.
pub(crate) fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor) -> Result<()> {
    let n = x.cols();
    ensure(gamma.len() == n && beta.len() == n, "layer_norm", || {
        format!(
            "rows have {n} features, gamma {} and beta {}",
            gamma.len(),
            beta.len()
        )
    })
}

/// LayerNorm's input gradient operands.
pub(crate) fn layer_norm_backward_input(
    x: &Tensor,
    gamma: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    dy: &Tensor,
) -> Result<()> {
    let rows = x.rows();
    ensure(
        gamma.len() == x.cols() && dy.len() == x.len() && mean.len() == rows && rstd.len() == rows,
        "layer_norm_backward_input",
        || {
            format!(
                "x {:?}, dy {:?}, gamma {}",
                x.shape(),
                dy.shape(),
                gamma.len()
            )
        },
    )
}

/// LayerNorm's parameter gradient operands; with `accumulate`, the accumulators too.
pub(crate) fn layer_norm_backward_params(
    x: &Tensor,
    (mean, rstd): (&Tensor, &Tensor),
    dy: &Tensor,
    (dgamma, dbeta): (&Tensor, &Tensor),
    accumulate: bool,
) -> Result<()> {
    let op = "layer_norm_backward_params";
    let (n, rows) = (x.cols(), x.rows());
    ensure(
        dy.len() == x.len() && mean.len() == rows && rstd.len() == rows,
        op,
        || format!("x {:?}, dy {:?}", x.shape(), dy.shape()),
    )?;
    ensure(
        !accumulate || (dgamma.len() == n && dbeta.len() == n),
        op,
        || {
            format!(
                "accumulators have {} and {}, rows {n}",
                dgamma.len(),
                dbeta.len()
            )
        },
    )
}

/// One label per row of the logits, and no more classes than columns.
pub(crate) fn label_count<E: Element>(
    logits: &Tensor,
    classes: usize,
    labels: &Tensor<E>,
) -> Result<()> {
    let rows = logits.rows();
    ensure(labels.len() == rows, "softmax_cross_entropy", || {
        format!("{rows} rows of logits but {} labels", labels.len())
    })?;
    ensure(classes <= logits.cols(), "softmax_cross_entropy", || {
        format!("{classes} classes but {} columns of logits", logits.cols())
    })
}

/// One gradient row of `width` per id.
pub(crate) fn embedding_backward(ids: &Tensor, dy: &Tensor, width: usize) -> Result<()> {
    ensure(dy.len() == ids.len() * width, "embedding backward", || {
        format!("{} ids but gradient {:?}", ids.len(), dy.shape())
    })
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
    ensure(
        out.len() == rows * c
            && dout.len() == rows * c
            && lse.len() == shape.batch * shape.heads * shape.seq,
        "attention backward",
        || {
            format!(
                "output {:?}, its gradient {:?} and log-sum-exp {:?} do not fit {shape:?}",
                out.shape(),
                dout.shape(),
                lse.shape()
            )
        },
    )
}

/// An SGD update's operands: the gradient, and the momentum buffer when momentum is on.
pub(crate) fn sgd(
    param: &Tensor,
    grad: &Tensor,
    buf: Option<&Tensor>,
    momentum: f32,
) -> Result<()> {
    ensure(param.len() == grad.len(), "sgd_update", || {
        format!("param {:?}, grad {:?}", param.shape(), grad.shape())
    })?;
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
    ensure(grad.len() == n && m.len() == n, "lion_update", || {
        format!("param {:?}, grad {:?}", param.shape(), grad.shape())
    })
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
    ensure(
        current.len() == n && stale.len() == n,
        "delay_compensate",
        || {
            format!(
                "grad {:?}, weights {:?}, stale weights {:?}",
                grad.shape(),
                current.shape(),
                stale.shape()
            )
        },
    )?;
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
    ensure(
        grad.len() == n && m.len() == n && v.len() == n,
        "adam_update",
        || format!("param {:?}, grad {:?}", param.shape(), grad.shape()),
    )
}

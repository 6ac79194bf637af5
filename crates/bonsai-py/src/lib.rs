//! Thin PyO3 binding (in progress).
use pyo3::prelude::*;

#[pymodule]
fn _bonsai(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}

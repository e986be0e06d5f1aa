//! Pieces shared by the GPU check and bench binaries in `src/bin/`.

use std::process::ExitCode;

use ddtree_runtime::RuntimeError;

pub use ddtree_runtime::timing::copy_bandwidth;

pub mod decode_ops;

/// The exit code of a run that returns whether every check passed.
pub fn exit_code(run: Result<bool, RuntimeError>) -> ExitCode {
    match run {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("some checks FAILED");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

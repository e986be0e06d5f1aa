//! NVRTC: compile generated CUDA C to PTX, with errors that show the log and the source.

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::RuntimeError;

/// Whether `libnvrtc` can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), RuntimeError> {
    if !nvrtc_available() {
        return Err(RuntimeError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    Ok((major, minor))
}

/// The options ddtree compiles with for `arch` (e.g. `sm_90a`).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string(), "-lineinfo".to_string()]
}

/// Compiles `source` (whose kernel is `symbol`) for `arch`, returning PTX.
pub fn compile_ptx(source: &str, symbol: &str, arch: &str) -> Result<Ptx, RuntimeError> {
    if !nvrtc_available() {
        return Err(RuntimeError::NoNvrtc);
    }
    let options = compile_options(arch);
    let opts = CompileOptions { options: options.clone(), name: Some(format!("{symbol}.cu")), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => {
            let log = log.to_string_lossy().into_owned();
            RuntimeError::Compile {
                kernel: symbol.to_string(),
                options: options.join(" "),
                excerpt: excerpt(source, &log),
                log,
            }
        }
        other => RuntimeError::Compile {
            kernel: symbol.to_string(),
            options: options.join(" "),
            log: format!("{other:?}"),
            excerpt: String::new(),
        },
    })
}

/// Numbered source lines (3 of context) around every `name.cu(LINE): error` in `log`; the whole
/// numbered source when the log names no line.
pub fn excerpt(source: &str, log: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let mut wanted: Vec<usize> = log
        .lines()
        .filter_map(|l| {
            let open = l.find(".cu(")? + 4;
            let close = l[open..].find(')')? + open;
            l[open..close].parse::<usize>().ok()
        })
        .collect();
    wanted.sort_unstable();
    wanted.dedup();
    let width = lines.len().to_string().len();
    let mut out = String::new();
    let mut shown = std::collections::BTreeSet::new();
    if wanted.is_empty() {
        shown.extend(1..=lines.len());
    }
    for w in &wanted {
        for n in w.saturating_sub(3).max(1)..=(*w + 3).min(lines.len()) {
            shown.insert(n);
        }
    }
    let mut prev = 0;
    for n in shown {
        if prev != 0 && n != prev + 1 {
            out.push_str("   ...\n");
        }
        let mark = if wanted.contains(&n) { ">" } else { " " };
        out.push_str(&format!("{mark}{n:>width$} | {}\n", lines[n - 1]));
        prev = n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpt_marks_error_lines_with_context() {
        let src = (1..=20).map(|i| format!("line {i}")).collect::<Vec<_>>().join("\n");
        let log = "k.cu(10): error: identifier \"x\" is undefined\n1 error detected";
        let ex = excerpt(&src, log);
        assert!(ex.contains(">10 | line 10"), "{ex}");
        assert!(ex.contains(" 7 | line 7") && ex.contains(" 13 | line 13"), "{ex}");
        assert!(!ex.contains("line 6\n") && !ex.contains("line 14"), "{ex}");
    }

    #[test]
    fn excerpt_without_line_shows_all() {
        let ex = excerpt("a\nb", "internal error");
        assert_eq!(ex, " 1 | a\n 2 | b\n");
    }
}

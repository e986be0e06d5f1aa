//! NVRTC: compile generated CUDA C to PTX or cubin, with errors that show the log, the options
//! and the numbered source lines around each error.

use std::ffi::CString;

use cudarc::nvrtc::{result, sys, Ptx};

use crate::RuntimeError;

/// Whether `libnvrtc` can be loaded on this machine.
pub fn nvrtc_available() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), RuntimeError> {
    if !nvrtc_available() {
        return Err(RuntimeError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    Ok((major, minor))
}

/// The options ddtree compiles with for `arch` (e.g. `sm_90a`).
pub fn compile_options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ]
}

/// Compiles `source` (whose kernel is `symbol`) for `arch`, returning PTX.
pub fn compile_ptx(source: &str, symbol: &str, arch: &str) -> Result<Ptx, RuntimeError> {
    let bytes = compile(source, symbol, &compile_options(arch), Output::Ptx)?;
    Ok(Ptx::from_src(
        String::from_utf8_lossy(&bytes).trim_end_matches('\0').to_string(),
    ))
}

/// Compiles `source` (whose kernel is `symbol`) with `options` (which must name a real
/// architecture, `--gpu-architecture=sm_XY`), returning the cubin, ready for
/// [`Ptx::from_binary`].
pub fn compile_cubin(source: &str, symbol: &str, options: &[String]) -> Result<Vec<u8>, RuntimeError> {
    compile(source, symbol, options, Output::Cubin)
}

#[derive(Clone, Copy)]
enum Output {
    Ptx,
    Cubin,
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` and destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn compile(source: &str, symbol: &str, options: &[String], output: Output) -> Result<Vec<u8>, RuntimeError> {
    if !nvrtc_available() {
        return Err(RuntimeError::NoNvrtc);
    }
    let fail = |log: String, excerpt: String| RuntimeError::Compile {
        kernel: symbol.to_string(),
        options: options.join(" "),
        log,
        excerpt,
    };
    let src = CString::new(source).map_err(|_| fail("the source contains a NUL byte".into(), String::new()))?;
    let name = CString::new(format!("{symbol}.cu"))
        .map_err(|_| fail("the symbol contains a NUL byte".into(), String::new()))?;
    let prog = Program(
        result::create_program(&src, Some(&name))
            .map_err(|e| fail(format!("nvrtcCreateProgram: {e}"), String::new()))?,
    );
    // SAFETY: `prog` is live until dropped at the end of this function.
    if let Err(e) = unsafe { result::compile_program(prog.0, options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|raw| {
                let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_else(|_| format!("{e} (no log)"));
        return Err(fail(log.clone(), excerpt(source, &log)));
    }
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `out` has the size NVRTC reports.
    let status = unsafe {
        match output {
            Output::Ptx => sys::nvrtcGetPTXSize(prog.0, &mut size),
            Output::Cubin => sys::nvrtcGetCUBINSize(prog.0, &mut size),
        }
        .result()
        .and_then(|()| {
            let mut out = vec![0u8; size];
            match output {
                Output::Ptx => sys::nvrtcGetPTX(prog.0, out.as_mut_ptr().cast()),
                Output::Cubin => sys::nvrtcGetCUBIN(prog.0, out.as_mut_ptr().cast()),
            }
            .result()
            .map(|()| out)
        })
    };
    let bytes = status.map_err(|e| fail(format!("reading the compiled output: {e}"), String::new()))?;
    if bytes.is_empty() {
        return Err(fail(
            "NVRTC produced no cubin: the options must name a real architecture (sm_XY)".into(),
            String::new(),
        ));
    }
    Ok(bytes)
}

/// Numbered source lines (3 of context) around every `name.cu(LINE): error` in `log` (around
/// the lines it names at all when none is an error); the whole numbered source when the log
/// names no line.
pub fn excerpt(source: &str, log: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let line_of = |l: &str| {
        let open = l.find(".cu(")? + 4;
        let close = l[open..].find(')')? + open;
        l[open..close].parse::<usize>().ok()
    };
    // Error lines only; warnings (unused variables, ...) only when there is no error line.
    let mut wanted: Vec<usize> = log
        .lines()
        .filter(|l| l.contains(": error"))
        .filter_map(line_of)
        .collect();
    if wanted.is_empty() {
        wanted = log.lines().filter_map(line_of).collect();
    }
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
    fn excerpt_prefers_errors_over_warnings() {
        let src = (1..=20).map(|i| format!("line {i}")).collect::<Vec<_>>().join("\n");
        let log = "k.cu(2): warning #177-D: variable \"v\" was declared but never referenced\nk.cu(15): error: expected a \";\"";
        let ex = excerpt(&src, log);
        assert!(ex.contains(">15 | line 15"), "{ex}");
        assert!(!ex.contains("line 2\n"), "{ex}");
    }

    #[test]
    fn excerpt_without_line_shows_all() {
        let ex = excerpt("a\nb", "internal error");
        assert_eq!(ex, " 1 | a\n 2 | b\n");
    }
}

//! Compile-time checking of a literal parameter space against the kernel's `comptime_assert!`s.
//!
//! When `space = [Params { .. }, ..]` lists struct literals with literal fields, each candidate
//! is evaluated against every top-level `comptime_assert!` (and the compile-time `let`s before
//! it); a candidate that fails is a compile error spanned on that candidate.

use std::collections::HashMap;

use syn::{Expr, Lit, Stmt};

#[derive(Clone, Debug, PartialEq)]
enum Val {
    Int(i128),
    Bool(bool),
    Path(String),
    Struct(HashMap<String, Val>),
}

fn eval(e: &Expr, env: &HashMap<String, Val>) -> Option<Val> {
    Some(match e {
        Expr::Lit(l) => match &l.lit {
            Lit::Int(i) => Val::Int(i.base10_parse().ok()?),
            Lit::Bool(b) => Val::Bool(b.value),
            _ => return None,
        },
        Expr::Paren(p) => eval(&p.expr, env)?,
        Expr::Group(g) => eval(&g.expr, env)?,
        Expr::Path(p) => {
            if p.path.segments.len() == 1 {
                env.get(&p.path.segments[0].ident.to_string())?.clone()
            } else {
                Val::Path(p.path.segments.last()?.ident.to_string())
            }
        }
        Expr::Field(f) => match (eval(&f.base, env)?, &f.member) {
            (Val::Struct(m), syn::Member::Named(n)) => m.get(&n.to_string())?.clone(),
            _ => return None,
        },
        Expr::Cast(c) => eval(&c.expr, env)?,
        Expr::Unary(u) => match (&u.op, eval(&u.expr, env)?) {
            (syn::UnOp::Neg(_), Val::Int(v)) => Val::Int(-v),
            (syn::UnOp::Not(_), Val::Bool(b)) => Val::Bool(!b),
            _ => return None,
        },
        Expr::MethodCall(m) => match (m.method.to_string().as_str(), eval(&m.receiver, env)?) {
            ("is_power_of_two", Val::Int(v)) if m.args.is_empty() => Val::Bool(v > 0 && v & (v - 1) == 0),
            ("min", Val::Int(v)) if m.args.len() == 1 => match eval(&m.args[0], env)? {
                Val::Int(w) => Val::Int(v.min(w)),
                _ => return None,
            },
            ("max", Val::Int(v)) if m.args.len() == 1 => match eval(&m.args[0], env)? {
                Val::Int(w) => Val::Int(v.max(w)),
                _ => return None,
            },
            _ => return None,
        },
        Expr::Binary(b) => {
            use syn::BinOp::*;
            let l = eval(&b.left, env)?;
            // Short-circuit like Rust.
            match (&b.op, &l) {
                (And(_), Val::Bool(false)) => return Some(Val::Bool(false)),
                (Or(_), Val::Bool(true)) => return Some(Val::Bool(true)),
                _ => {}
            }
            let r = eval(&b.right, env)?;
            match (l, r) {
                (Val::Int(x), Val::Int(y)) => match b.op {
                    Add(_) => Val::Int(x + y),
                    Sub(_) => Val::Int(x - y),
                    Mul(_) => Val::Int(x * y),
                    Div(_) if y != 0 => Val::Int(x / y),
                    Rem(_) if y != 0 => Val::Int(x % y),
                    BitAnd(_) => Val::Int(x & y),
                    BitOr(_) => Val::Int(x | y),
                    BitXor(_) => Val::Int(x ^ y),
                    Shl(_) if (0..64).contains(&y) => Val::Int(x << y),
                    Shr(_) if (0..64).contains(&y) => Val::Int(x >> y),
                    Eq(_) => Val::Bool(x == y),
                    Ne(_) => Val::Bool(x != y),
                    Lt(_) => Val::Bool(x < y),
                    Le(_) => Val::Bool(x <= y),
                    Gt(_) => Val::Bool(x > y),
                    Ge(_) => Val::Bool(x >= y),
                    _ => return None,
                },
                (Val::Bool(x), Val::Bool(y)) => match b.op {
                    And(_) => Val::Bool(x && y),
                    Or(_) => Val::Bool(x || y),
                    Eq(_) => Val::Bool(x == y),
                    Ne(_) => Val::Bool(x != y),
                    _ => return None,
                },
                (Val::Path(x), Val::Path(y)) => match b.op {
                    Eq(_) => Val::Bool(x == y),
                    Ne(_) => Val::Bool(x != y),
                    _ => return None,
                },
                _ => return None,
            }
        }
        _ => return None,
    })
}

/// A candidate written as a struct literal with literal fields.
fn candidate(e: &Expr) -> Option<Val> {
    match e {
        Expr::Struct(s) if s.rest.is_none() => {
            let mut m = HashMap::new();
            for f in &s.fields {
                let syn::Member::Named(n) = &f.member else { return None };
                m.insert(n.to_string(), eval(&f.expr, &HashMap::new())?);
            }
            Some(Val::Struct(m))
        }
        _ => None,
    }
}

/// Checks each literal candidate of `space` against the top-level `comptime_assert!`s of `body`.
pub fn check_space(space: &[Expr], param: &str, body: &[Stmt], errors: &mut Vec<syn::Error>) {
    for cand in space {
        let Some(v) = candidate(cand) else { continue };
        let mut env = HashMap::new();
        env.insert(param.to_string(), v);
        for s in body {
            match s {
                Stmt::Local(l) => {
                    if let (syn::Pat::Ident(pi), Some(init)) = (&l.pat, &l.init) {
                        if let Some(val) = eval(&init.expr, &env) {
                            env.insert(pi.ident.to_string(), val);
                        } else {
                            env.remove(&pi.ident.to_string());
                        }
                    }
                }
                Stmt::Macro(m) if m.mac.path.is_ident("comptime_assert") => {
                    check_assert(&m.mac, cand, &env, errors);
                }
                Stmt::Expr(Expr::Macro(m), _) if m.mac.path.is_ident("comptime_assert") => {
                    check_assert(&m.mac, cand, &env, errors);
                }
                _ => {}
            }
        }
    }
}

fn check_assert(mac: &syn::Macro, cand: &Expr, env: &HashMap<String, Val>, errors: &mut Vec<syn::Error>) {
    let Ok(args) = mac.parse_body_with(syn::punctuated::Punctuated::<Expr, syn::Token![,]>::parse_terminated) else {
        return;
    };
    let Some(cond) = args.first() else { return };
    if eval(cond, env) == Some(Val::Bool(false)) {
        let msg = match args.iter().nth(1) {
            Some(Expr::Lit(syn::ExprLit { lit: Lit::Str(s), .. })) => format!(": {}", s.value()),
            _ => String::new(),
        };
        let cond_s = quote::ToTokens::to_token_stream(cond).to_string();
        errors.push(syn::Error::new_spanned(
            cand,
            format!("invalid parameter combination: `comptime_assert!({cond_s})` fails for this candidate{msg}"),
        ));
    }
}

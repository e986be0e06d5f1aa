//! Translation of a kernel body into Rust code that drives `ddtree_codegen::Builder`.
//!
//! Expressions over compile-time names (the params argument, `let` bindings of such
//! expressions, literals, constants and enum paths) are left as Rust and evaluated when the IR is
//! built; everything else becomes builder calls. Errors are collected, each spanned on the
//! offending tokens, and the translation goes on so the user sees all of them at once.

use std::collections::HashMap;

use ddtree_codegen::intrinsics::Intrinsic;
use ddtree_codegen::ir::Builtin;
use ddtree_codegen::Scalar;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::{Expr, Lit, Pat, Stmt};

#[derive(Clone, Copy, PartialEq, Eq)]
enum VarKind {
    Comptime,
    Runtime,
}

/// Translation state: errors so far and the scopes of DSL names.
pub struct Cx {
    /// Accumulated errors.
    pub errors: Vec<syn::Error>,
    scopes: Vec<HashMap<String, VarKind>>,
    /// Whether a trailing expression is the function's return value.
    pub returns_value: bool,
}

/// The builder variable in generated code.
fn b() -> TokenStream {
    quote!(__b)
}

/// `::ddtree_codegen::Loc { .. }` for a span.
pub fn loc(span: Span) -> TokenStream {
    let lc = span.start();
    let (line, col) = (lc.line as u32, lc.column as u32 + 1);
    quote!(::ddtree_codegen::Loc { line: #line, col: #col })
}

/// Tokens naming a scalar type.
pub fn scalar_tokens(s: Scalar) -> TokenStream {
    let id = format_ident!("{}", format!("{s:?}"));
    quote!(::ddtree_codegen::Scalar::#id)
}

/// A scalar type named by a path (`f32`, `bf16`, ...).
pub fn scalar_of_type(ty: &syn::Type) -> Option<Scalar> {
    match ty {
        syn::Type::Path(p) if p.qself.is_none() => {
            let seg = p.path.segments.last()?;
            if p.path.segments.len() > 1 && !matches!(seg.ident.to_string().as_str(), "bf16" | "f16") {
                return None;
            }
            Scalar::from_rust_name(&seg.ident.to_string())
        }
        _ => None,
    }
}

/// Whether a type is `u32x4`.
pub fn is_u32x4(ty: &syn::Type) -> bool {
    matches!(ty, syn::Type::Path(p) if p.path.segments.last().is_some_and(|s| s.ident == "u32x4"))
}

fn single_ident(path: &syn::Path) -> Option<String> {
    if path.leading_colon.is_none() && path.segments.len() == 1 && path.segments[0].arguments.is_none() {
        Some(path.segments[0].ident.to_string())
    } else {
        None
    }
}

fn binop(op: &syn::BinOp) -> Option<(&'static str, bool)> {
    use syn::BinOp::*;
    Some(match op {
        Add(_) => ("Add", false),
        Sub(_) => ("Sub", false),
        Mul(_) => ("Mul", false),
        Div(_) => ("Div", false),
        Rem(_) => ("Rem", false),
        BitAnd(_) => ("BitAnd", false),
        BitOr(_) => ("BitOr", false),
        BitXor(_) => ("BitXor", false),
        Shl(_) => ("Shl", false),
        Shr(_) => ("Shr", false),
        Eq(_) => ("Eq", false),
        Ne(_) => ("Ne", false),
        Lt(_) => ("Lt", false),
        Le(_) => ("Le", false),
        Gt(_) => ("Gt", false),
        Ge(_) => ("Ge", false),
        And(_) => ("And", false),
        Or(_) => ("Or", false),
        AddAssign(_) => ("Add", true),
        SubAssign(_) => ("Sub", true),
        MulAssign(_) => ("Mul", true),
        DivAssign(_) => ("Div", true),
        RemAssign(_) => ("Rem", true),
        BitAndAssign(_) => ("BitAnd", true),
        BitOrAssign(_) => ("BitOr", true),
        BitXorAssign(_) => ("BitXor", true),
        ShlAssign(_) => ("Shl", true),
        ShrAssign(_) => ("Shr", true),
        _ => return None,
    })
}

fn binop_tokens(name: &str) -> TokenStream {
    let id = format_ident!("{name}");
    quote!(::ddtree_codegen::ir::BinOp::#id)
}

impl Cx {
    /// A translator with the compile-time names `comptime` and runtime names `runtime` in scope.
    pub fn new(comptime: &[String], runtime: &[String], returns_value: bool) -> Cx {
        let mut top = HashMap::new();
        for c in comptime {
            top.insert(c.clone(), VarKind::Comptime);
        }
        for r in runtime {
            top.insert(r.clone(), VarKind::Runtime);
        }
        Cx {
            errors: Vec::new(),
            scopes: vec![top],
            returns_value,
        }
    }

    fn error(&mut self, tokens: impl ToTokens, msg: impl std::fmt::Display) -> TokenStream {
        self.errors.push(syn::Error::new_spanned(tokens, msg));
        quote!(::core::unreachable!())
    }

    fn push(&mut self) {
        self.scopes.push(HashMap::new());
    }

    fn pop(&mut self) {
        self.scopes.pop();
    }

    fn define(&mut self, name: String, kind: VarKind) {
        self.scopes.last_mut().expect("scope").insert(name, kind);
    }

    fn kind(&self, name: &str) -> Option<VarKind> {
        self.scopes.iter().rev().find_map(|s| s.get(name).copied())
    }

    /// Whether `e` can be evaluated when the source is generated.
    pub fn is_comptime(&self, e: &Expr) -> bool {
        match e {
            Expr::Lit(_) => true,
            Expr::Path(p) => match single_ident(&p.path) {
                Some(name) => match self.kind(&name) {
                    Some(k) => k == VarKind::Comptime,
                    // Unknown single names: SCREAMING_CASE constants are Rust consts.
                    None => name
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'),
                },
                None => p.path.segments.len() > 1,
            },
            Expr::Field(f) => self.is_comptime(&f.base),
            Expr::Binary(b) => {
                binop(&b.op).is_some_and(|(_, a)| !a) && self.is_comptime(&b.left) && self.is_comptime(&b.right)
            }
            Expr::Unary(u) => !matches!(u.op, syn::UnOp::Deref(_)) && self.is_comptime(&u.expr),
            Expr::Paren(p) => self.is_comptime(&p.expr),
            Expr::Group(g) => self.is_comptime(&g.expr),
            Expr::Cast(c) => scalar_of_type(&c.ty).is_some_and(|s| !s.is_half()) && self.is_comptime(&c.expr),
            Expr::MethodCall(m) => {
                self.is_comptime(&m.receiver)
                    && m.args.iter().all(|a| self.is_comptime(a))
                    && !matches!(m.method.to_string().as_str(), "vload" | "vstore" | "to_bits")
                    && !matches!(&*m.receiver, Expr::Lit(_))
            }
            Expr::Macro(m) => m.mac.path.is_ident("comptime"),
            _ => false,
        }
    }

    fn comptime_value(&self, e: &Expr) -> TokenStream {
        let e = match e {
            Expr::Macro(m) if m.mac.path.is_ident("comptime") => {
                let t = &m.mac.tokens;
                quote!((#t))
            }
            other => quote!((#other)),
        };
        quote!(::ddtree_codegen::ops::Comptime::to_expr(&#e))
    }

    /// Wraps an `OpError` result at `span` into the builder's located error.
    fn at(&self, span: Span, r: TokenStream) -> TokenStream {
        let b = b();
        let l = loc(span);
        quote!(#b.at(#l, #r)?)
    }

    /// Translates an expression in runtime position; the tokens evaluate to a codegen `Expr`.
    pub fn rt(&mut self, e: &Expr) -> TokenStream {
        let b = b();
        let span = e.span();
        match e {
            Expr::Lit(l) => return self.lit(&l.lit),
            Expr::Paren(p) => return self.rt(&p.expr),
            Expr::Group(g) => return self.rt(&g.expr),
            _ => {}
        }
        if let Expr::Path(p) = e {
            if let Some(name) = single_ident(&p.path) {
                match self.kind(&name) {
                    Some(VarKind::Runtime) => {
                        let l = loc(span);
                        return quote!(#b.var(#name, #l)?);
                    }
                    Some(VarKind::Comptime) => return self.comptime_value(e),
                    None if self.is_comptime(e) => return self.comptime_value(e),
                    None => return self.error(e, format!("cannot find `{name}` in this kernel")),
                }
            }
            let segs: Vec<String> = p.path.segments.iter().map(|s| s.ident.to_string()).collect();
            // Constants (`f32::INFINITY`, `f32::consts::LN_2`, `crate::TILE`) are Rust values;
            // enum variants are CamelCase and have no runtime representation.
            let last = segs.last().map(String::as_str).unwrap_or("");
            if last
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
            {
                return self.comptime_value(e);
            }
            return self.error(
                e,
                "enum values and paths are compile-time only: compare them in a compile-time `if` on the params",
            );
        }
        if self.is_comptime(e) {
            return self.comptime_value(e);
        }
        match e {
            Expr::Binary(bin) => {
                let Some((op, false)) = binop(&bin.op) else {
                    return self.error(bin.op, "compound assignment is a statement, not an expression");
                };
                let l = self.rt(&bin.left);
                let r = self.rt(&bin.right);
                let op = binop_tokens(op);
                let call = self.at(bin.op.span(), quote!(::ddtree_codegen::ops::binary(#op, __l, __r)));
                quote!({ let __l = #l; let __r = #r; #call })
            }
            Expr::Unary(u) => {
                let op = match u.op {
                    syn::UnOp::Neg(_) => quote!(::ddtree_codegen::ir::UnOp::Neg),
                    syn::UnOp::Not(_) => quote!(::ddtree_codegen::ir::UnOp::Not),
                    _ => return self.error(u, "dereference `*` is not supported; index slices with `x[i]`"),
                };
                let a = self.rt(&u.expr);
                let call = self.at(span, quote!(::ddtree_codegen::ops::unary(#op, __a)));
                quote!({ let __a = #a; #call })
            }
            Expr::Cast(c) => {
                let Some(s) = scalar_of_type(&c.ty) else {
                    return self.error(
                        &c.ty,
                        "casts go to a DSL scalar type: f32, bf16, f16, u32, i32, u64 or bool",
                    );
                };
                let a = self.rt(&c.expr);
                let s = scalar_tokens(s);
                let call = self.at(span, quote!(::ddtree_codegen::ops::cast(__a, #s)));
                quote!({ let __a = #a; #call })
            }
            Expr::Index(ix) => {
                let base = self.rt(&ix.expr);
                let i = self.rt(&ix.index);
                let call = self.at(span, quote!(::ddtree_codegen::ops::index(__x, __i)));
                quote!({ let __x = #base; let __i = #i; #call })
            }
            Expr::Field(f) => {
                let name = match &f.member {
                    syn::Member::Named(n) => n.to_string(),
                    syn::Member::Unnamed(_) => return self.error(f, "tuple fields are not supported"),
                };
                let base = self.rt(&f.base);
                let call = self.at(span, quote!(::ddtree_codegen::ops::field(__x, #name)));
                quote!({ let __x = #base; #call })
            }
            Expr::Reference(r) => {
                let m = r.mutability.is_some();
                if let Expr::Index(ix) = &*r.expr {
                    if let Expr::Range(range) = &*ix.index {
                        // `&x[a..]`: a sub-slice.
                        let (Some(start), None, syn::RangeLimits::HalfOpen(_)) =
                            (&range.start, &range.end, &range.limits)
                        else {
                            return self.error(range, "a sub-slice is `&x[a..]`: a start and no end");
                        };
                        let base = self.rt(&ix.expr);
                        let off = self.rt(start);
                        let call = self.at(span, quote!(::ddtree_codegen::ops::sub_slice(__x, __o, #m)));
                        return quote!({ let __x = #base; let __o = #off; #call });
                    }
                }
                let inner = self.rt(&r.expr);
                let call = self.at(span, quote!(::ddtree_codegen::ops::addr_of(__x, #m)));
                quote!({ let __x = #inner; #call })
            }
            Expr::MethodCall(m) => {
                let name = m.method.to_string();
                if name == "vstore" {
                    return self.error(&m.method, "`vstore` is a statement: write `x.vstore(i, v);`");
                }
                if m.turbofish.is_some() {
                    return self.error(m, "generic method calls are not supported");
                }
                let recv = self.rt(&m.receiver);
                let args: Vec<TokenStream> = m.args.iter().map(|a| self.rt(a)).collect();
                let call = self.at(m.method.span(), quote!(::ddtree_codegen::ops::method(__r, #name, __a)));
                quote!({ let __r = #recv; let __a = ::std::vec![#(#args),*]; #call })
            }
            Expr::Call(c) => self.call(c),
            Expr::If(i) => {
                let (Some((_, els)), true) = (&i.else_branch, i.then_branch.stmts.len() == 1) else {
                    return self.error(
                        i,
                        "an `if` used as a value needs an `else` and one expression per branch",
                    );
                };
                let then_e = match &i.then_branch.stmts[0] {
                    Stmt::Expr(e, None) => e,
                    other => return self.error(other, "expected one expression"),
                };
                let else_e = match &**els {
                    Expr::Block(bl) if bl.block.stmts.len() == 1 => match &bl.block.stmts[0] {
                        Stmt::Expr(e, None) => e.clone(),
                        other => return self.error(other, "expected one expression"),
                    },
                    other @ Expr::If(_) => other.clone(),
                    other => return self.error(other, "expected `else { expression }`"),
                };
                if self.is_comptime(&i.cond) {
                    let c = &i.cond;
                    let t = self.rt(then_e);
                    let f = self.rt(&else_e);
                    return quote!(if #c { #t } else { #f });
                }
                let c = self.rt(&i.cond);
                let t = self.rt(then_e);
                let f = self.rt(&else_e);
                let call = self.at(span, quote!(::ddtree_codegen::ops::select(__c, __t, __f)));
                quote!({ let __c = #c; let __t = #t; let __f = #f; #call })
            }
            Expr::Macro(m) if m.mac.path.is_ident("comptime") => {
                let inner: Expr = match m.mac.parse_body() {
                    Ok(e) => e,
                    Err(err) => {
                        self.errors.push(err);
                        return quote!(::core::unreachable!());
                    }
                };
                if !self.is_comptime(&inner) && !matches!(inner, Expr::Call(_)) {
                    return self.error(m, "`comptime!` needs an expression over compile-time values");
                }
                self.comptime_value(e)
            }
            Expr::Closure(_) => self.error(e, "closures are not supported in kernels"),
            Expr::Match(_) => self.error(e, "`match` is not supported in kernels; use `if` / `else if`"),
            Expr::Tuple(_) => self.error(e, "tuples are not supported in kernels"),
            Expr::Array(_) | Expr::Repeat(_) => {
                self.error(e, "array expressions are allowed only as `let a = [value; N];`")
            }
            Expr::Range(_) => self.error(e, "ranges are allowed only in `for` loops and sub-slices (`&x[a..]`)"),
            Expr::Try(_) => self.error(e, "`?` is not supported in kernels"),
            Expr::Struct(_) => self.error(e, "struct literals are not supported in kernels"),
            Expr::Block(_) | Expr::Loop(_) | Expr::While(_) | Expr::ForLoop(_) => {
                self.error(e, "blocks and loops cannot be used as values")
            }
            _ => self.error(e, "unsupported expression in a kernel"),
        }
    }

    fn lit(&mut self, l: &Lit) -> TokenStream {
        match l {
            Lit::Int(i) => {
                let v: i128 = match i.base10_parse() {
                    Ok(v) => v,
                    Err(e) => {
                        self.errors.push(e);
                        return quote!(::core::unreachable!());
                    }
                };
                let suffix = match i.suffix() {
                    "" => quote!(::core::option::Option::None),
                    s => match Scalar::from_rust_name(s) {
                        Some(sc) if sc.is_int() || sc == Scalar::F32 => {
                            let t = scalar_tokens(sc);
                            quote!(::core::option::Option::Some(#t))
                        }
                        _ => {
                            return self.error(
                                i,
                                format!("integer suffix `{s}` is not a DSL type (use u32, i32, u64 or f32)"),
                            )
                        }
                    },
                };
                self.at(i.span(), quote!(::ddtree_codegen::ops::int_lit(#v, #suffix)))
            }
            Lit::Float(f) => {
                if !matches!(f.suffix(), "" | "f32") {
                    return self.error(f, "only f32 floats are supported in kernels");
                }
                let v: f32 = match f.base10_parse() {
                    Ok(v) => v,
                    Err(e) => {
                        self.errors.push(e);
                        return quote!(::core::unreachable!());
                    }
                };
                quote!(::ddtree_codegen::ops::float_lit(#v))
            }
            Lit::Bool(bl) => {
                let v = bl.value;
                quote!(::ddtree_codegen::ops::bool_lit(#v))
            }
            other => self.error(other, "unsupported literal in a kernel"),
        }
    }

    fn call(&mut self, c: &syn::ExprCall) -> TokenStream {
        let b = b();
        let span = c.span();
        let Expr::Path(fp) = &*c.func else {
            return self.error(&c.func, "only named functions can be called in kernels");
        };
        let args = &c.args;
        if let Some(name) = single_ident(&fp.path) {
            if let Some(bi) = Builtin::from_dsl(&name) {
                if !args.is_empty() {
                    return self.error(args, format!("`{name}()` takes no arguments"));
                }
                let id = format_ident!("{}", format!("{bi:?}"));
                return quote!(::ddtree_codegen::ops::builtin(::ddtree_codegen::ir::Builtin::#id));
            }
            if name == "sync_threads" {
                return self.error(c, "`sync_threads()` is a statement, not a value");
            }
            if matches!(name.as_str(), "shared" | "shared_2d" | "dyn_shared") {
                return self.error(
                    c,
                    format!("`{name}` declares memory: use it as `let s = {name}::<T>(..);`"),
                );
            }
            if let Some(i) = Intrinsic::from_dsl(&name) {
                if args.len() != i.arity() {
                    return self.error(
                        c,
                        format!("`{name}` takes {} argument(s), got {}", i.arity(), args.len()),
                    );
                }
                if let Some(ct) = i.comptime_arg() {
                    if !self.is_comptime(&args[ct]) {
                        return self.error(
                            &args[ct],
                            format!("argument {} of `{name}` must be a compile-time value", ct + 1),
                        );
                    }
                }
                let a: Vec<TokenStream> = args.iter().map(|x| self.rt(x)).collect();
                let id = format_ident!("{}", format!("{i:?}"));
                let call = self.at(
                    span,
                    quote!(::ddtree_codegen::ops::intrinsic(::ddtree_codegen::intrinsics::Intrinsic::#id, __a)),
                );
                return quote!({ let __a = ::std::vec![#(#a),*]; #call });
            }
        }
        let segs: Vec<String> = fp.path.segments.iter().map(|s| s.ident.to_string()).collect();
        if segs == ["f32", "from_bits"] {
            if args.len() != 1 {
                return self.error(c, "`f32::from_bits` takes one argument");
            }
            let a = self.rt(&args[0]);
            let call = self.at(
                span,
                quote!(::ddtree_codegen::ops::bitcast(__a, ::ddtree_codegen::Scalar::F32)),
            );
            return quote!({ let __a = #a; #call });
        }
        // A #[device_fn]: its module carries the IR builder.
        let path = &fp.path;
        let a: Vec<TokenStream> = args.iter().map(|x| self.rt(x)).collect();
        let l = loc(span);
        quote_spanned! {span=>
            {
                let __a = ::std::vec![#(#a),*];
                let __def = #path::__ddtree_device_fn()?;
                #b.call_device(__def, __a, #l)?
            }
        }
    }

    /// Translates a list of statements (no Rust block around them).
    pub fn stmts(&mut self, stmts: &[Stmt]) -> TokenStream {
        let mut out = TokenStream::new();
        let n = stmts.len();
        for (k, s) in stmts.iter().enumerate() {
            out.extend(self.stmt(s, k + 1 == n));
        }
        out
    }

    fn scoped_block(&mut self, stmts: &[Stmt]) -> TokenStream {
        self.push();
        let t = self.stmts(stmts);
        self.pop();
        framed(t)
    }

    fn stmt(&mut self, s: &Stmt, last: bool) -> TokenStream {
        match s {
            Stmt::Local(l) => self.local(l),
            Stmt::Item(i) => {
                self.error(i, "items (fn, struct, use, ...) cannot be declared inside a kernel");
                TokenStream::new()
            }
            Stmt::Expr(e, semi) => {
                if last && semi.is_none() && self.returns_value && !is_statement_like(e) {
                    let v = self.rt(e);
                    let l = loc(e.span());
                    return quote!({ let __v = #v; __b.return_(::core::option::Option::Some(__v), #l)?; });
                }
                self.expr_stmt(e)
            }
            Stmt::Macro(m) => self.macro_stmt(&m.mac),
        }
    }

    fn macro_stmt(&mut self, mac: &syn::Macro) -> TokenStream {
        if !mac.path.is_ident("comptime_assert") {
            self.error(
                mac,
                "the only statement macro in kernels is `comptime_assert!(cond, \"message\")`",
            );
            return TokenStream::new();
        }
        let parsed = mac.parse_body_with(syn::punctuated::Punctuated::<Expr, syn::Token![,]>::parse_terminated);
        let args = match parsed {
            Ok(a) => a,
            Err(e) => {
                self.errors.push(e);
                return TokenStream::new();
            }
        };
        let mut it = args.iter();
        let Some(cond) = it.next() else {
            self.error(mac, "`comptime_assert!` needs a condition");
            return TokenStream::new();
        };
        if !self.is_comptime(cond) {
            self.error(
                cond,
                "`comptime_assert!` conditions must be compile-time (params, constants, literals)",
            );
            return TokenStream::new();
        }
        let rest: Vec<&Expr> = it.collect();
        let msg = if rest.is_empty() {
            quote!("")
        } else {
            quote!(::std::format!(#(#rest),*))
        };
        let text = cond.to_token_stream().to_string();
        let l = loc(cond.span());
        quote! {
            if !(#cond) {
                return __b.fail(#l, ::std::format!("comptime_assert!({}) failed for these params: {}", #text, #msg));
            }
        }
    }

    fn local(&mut self, l: &syn::Local) -> TokenStream {
        let b = b();
        let (ident, mutable, ty) = match &l.pat {
            Pat::Ident(pi) if pi.subpat.is_none() && pi.by_ref.is_none() => (&pi.ident, pi.mutability.is_some(), None),
            Pat::Type(pt) => match &*pt.pat {
                Pat::Ident(pi) if pi.subpat.is_none() && pi.by_ref.is_none() => {
                    (&pi.ident, pi.mutability.is_some(), Some(&*pt.ty))
                }
                other => {
                    self.error(other, "only `let name` / `let mut name` patterns are supported");
                    return TokenStream::new();
                }
            },
            other => {
                self.error(other, "only `let name` / `let mut name` patterns are supported");
                return TokenStream::new();
            }
        };
        let name = ident.to_string();
        let Some(init) = &l.init else {
            self.error(l, "kernel variables need an initial value");
            return TokenStream::new();
        };
        if init.diverge.is_some() {
            self.error(l, "`let ... else` is not supported");
            return TokenStream::new();
        }
        let init = &*init.expr;
        let lc = loc(l.span());

        // Shared memory.
        if let Expr::Call(c) = init {
            if let Expr::Path(fp) = &*c.func {
                let last = fp.path.segments.last().expect("path");
                let fname = last.ident.to_string();
                if fp.path.segments.len() == 1 && matches!(fname.as_str(), "shared" | "shared_2d" | "dyn_shared") {
                    // Declared before validation so a rejected size does not cascade into
                    // "cannot find" errors at every use.
                    self.define(name.clone(), VarKind::Runtime);
                    let elem = match &last.arguments {
                        syn::PathArguments::AngleBracketed(ab) if ab.args.len() == 1 => match &ab.args[0] {
                            syn::GenericArgument::Type(t) => scalar_of_type(t),
                            _ => None,
                        },
                        _ => None,
                    };
                    let Some(elem) = elem else {
                        self.error(&fp.path, format!("write `{fname}::<T>(..)` with T a DSL scalar type"));
                        return TokenStream::new();
                    };
                    if fname == "dyn_shared" {
                        if !c.args.is_empty() {
                            self.error(
                                c,
                                "`dyn_shared::<T>()` takes no arguments: its size is `dyn_smem` of `#[kernel(..)]`",
                            );
                            return TokenStream::new();
                        }
                        let et = scalar_tokens(elem);
                        return quote! {
                            #b.dyn_shared(#name, #et, #lc)?;
                        };
                    }
                    let want = if fname == "shared" { 1 } else { 2 };
                    if c.args.len() != want {
                        self.error(c, format!("`{fname}` takes {want} compile-time size(s)"));
                        return TokenStream::new();
                    }
                    for a in &c.args {
                        if !self.is_comptime(a) {
                            self.error(a, "shared-memory sizes must be compile-time values");
                            return TokenStream::new();
                        }
                    }
                    let dims = c.args.iter().map(|a| quote!((#a) as i128));
                    let et = scalar_tokens(elem);
                    self.define(name.clone(), VarKind::Runtime);
                    return quote! {
                        #b.array(#name, #et, ::std::vec![#(#dims),*], ::ddtree_codegen::Space::Shared, ::core::option::Option::None, #lc)?;
                    };
                }
            }
        }

        // Register arrays: `[v; N]` or `[[v; N]; M]`.
        if let Expr::Repeat(_) = init {
            self.define(name.clone(), VarKind::Runtime);
            let mut dims = Vec::new();
            let mut cur = init;
            while let Expr::Repeat(r) = cur {
                if !self.is_comptime(&r.len) {
                    self.error(&r.len, "array lengths must be compile-time values");
                    return TokenStream::new();
                }
                dims.push(&*r.len);
                cur = &r.expr;
            }
            let elem = ty.and_then(array_elem).or_else(|| lit_scalar(cur));
            let Some(elem) = elem else {
                self.error(cur, "cannot tell the element type: use a typed literal such as `0.0f32` or `0u32`, or annotate the array");
                return TokenStream::new();
            };
            let fill = self.rt(cur);
            let et = scalar_tokens(elem);
            let dims = dims.iter().map(|d| quote!((#d) as i128));
            self.define(name.clone(), VarKind::Runtime);
            return quote! {
                {
                    let __f = #fill;
                    #b.array(#name, #et, ::std::vec![#(#dims),*], ::ddtree_codegen::Space::Local, ::core::option::Option::Some(__f), #lc)?;
                }
            };
        }

        let ty_tokens = match ty {
            None => quote!(::core::option::Option::None),
            Some(t) if is_u32x4(t) => quote!(::core::option::Option::Some(::ddtree_codegen::Ty::U32x4)),
            Some(t) => match scalar_of_type(t) {
                Some(s) => {
                    let st = scalar_tokens(s);
                    quote!(::core::option::Option::Some(::ddtree_codegen::Ty::Scalar(#st)))
                }
                None => {
                    self.error(
                        t,
                        "variables have a DSL scalar type (f32, bf16, f16, u32, i32, u64, bool) or u32x4",
                    );
                    return TokenStream::new();
                }
            },
        };
        let comptime_ok = ty.is_none_or(|t| scalar_of_type(t).is_some_and(|s| !s.is_half()));
        if !mutable && comptime_ok && self.is_comptime(init) {
            let value = match init {
                Expr::Macro(m) if m.mac.path.is_ident("comptime") => m.mac.tokens.clone(),
                other => other.to_token_stream(),
            };
            self.define(name, VarKind::Comptime);
            return match ty {
                Some(t) => quote!(#[allow(unused_variables)] let #ident: #t = #value;),
                None => quote!(#[allow(unused_variables)] let #ident = #value;),
            };
        }
        let v = self.rt(init);
        self.define(name.clone(), VarKind::Runtime);
        quote! {
            {
                let __v = #v;
                #b.let_(#name, #ty_tokens, __v, #mutable, #lc)?;
            }
        }
    }

    fn expr_stmt(&mut self, e: &Expr) -> TokenStream {
        let b = b();
        let lc = loc(e.span());
        match e {
            Expr::Assign(a) => {
                if let Expr::Infer(_) = &*a.left {
                    let v = self.rt(&a.right);
                    return quote!({ let __v = #v; #b.expr_stmt(__v, #lc); });
                }
                let p = self.rt(&a.left);
                let v = self.rt(&a.right);
                quote!({ let __p = #p; let __v = #v; #b.assign(__p, ::core::option::Option::None, __v, #lc)?; })
            }
            Expr::Binary(bin) if binop(&bin.op).is_some_and(|(_, a)| a) => {
                let (op, _) = binop(&bin.op).expect("checked");
                let op = binop_tokens(op);
                let p = self.rt(&bin.left);
                let v = self.rt(&bin.right);
                quote!({ let __p = #p; let __v = #v; #b.assign(__p, ::core::option::Option::Some(#op), __v, #lc)?; })
            }
            Expr::If(i) => self.if_stmt(i),
            Expr::ForLoop(f) => self.for_loop(f),
            Expr::While(w) => {
                if w.label.is_some() {
                    return self.error(&w.label, "loop labels are not supported");
                }
                if let Expr::Let(_) = &*w.cond {
                    return self.error(&w.cond, "`while let` is not supported");
                }
                let c = self.rt(&w.cond);
                let body = self.scoped_block(&w.body.stmts);
                quote!({ let __c = #c; #b.open(); #body let __s = #b.close(); #b.while_(__c, __s, #lc)?; })
            }
            Expr::Loop(lp) => {
                if lp.label.is_some() {
                    return self.error(&lp.label, "loop labels are not supported");
                }
                let body = self.scoped_block(&lp.body.stmts);
                quote!({ #b.open(); #body let __s = #b.close(); #b.while_(::ddtree_codegen::ops::bool_lit(true), __s, #lc)?; })
            }
            Expr::Break(br) => {
                if br.label.is_some() || br.expr.is_some() {
                    return self.error(br, "`break` takes no label or value in kernels");
                }
                quote!(#b.break_();)
            }
            Expr::Continue(c) => {
                if c.label.is_some() {
                    return self.error(c, "`continue` takes no label in kernels");
                }
                quote!(#b.continue_();)
            }
            Expr::Return(r) => match &r.expr {
                None => quote!(#b.return_(::core::option::Option::None, #lc)?;),
                Some(v) => {
                    let v = self.rt(v);
                    quote!({ let __v = #v; #b.return_(::core::option::Option::Some(__v), #lc)?; })
                }
            },
            Expr::Macro(m) => self.macro_stmt(&m.mac),
            Expr::Block(bl) => {
                if bl.label.is_some() {
                    return self.error(bl, "block labels are not supported");
                }
                let body = self.scoped_block(&bl.block.stmts);
                quote!({ #b.open(); #body let __s = #b.close(); #b.splice(__s); })
            }
            Expr::Call(c) if matches!(&*c.func, Expr::Path(p) if p.path.is_ident("sync_threads")) => {
                if !c.args.is_empty() {
                    return self.error(&c.args, "`sync_threads()` takes no arguments");
                }
                quote!(#b.sync_threads(#lc);)
            }
            Expr::MethodCall(m) if m.method == "vstore" => {
                if m.args.len() != 2 {
                    return self.error(m, "`vstore` takes an index and a u32x4 value");
                }
                let x = self.rt(&m.receiver);
                let i = self.rt(&m.args[0]);
                let v = self.rt(&m.args[1]);
                quote!({ let __x = #x; let __i = #i; let __v = #v; #b.vstore(__x, __i, __v, #lc)?; })
            }
            other => {
                let v = self.rt(other);
                quote!({ let __v = #v; #b.expr_stmt(__v, #lc); })
            }
        }
    }

    fn if_stmt(&mut self, i: &syn::ExprIf) -> TokenStream {
        let b = b();
        if let Expr::Let(_) = &*i.cond {
            return self.error(&i.cond, "`if let` is not supported in kernels");
        }
        let then_t = self.scoped_block(&i.then_branch.stmts);
        let else_t = match &i.else_branch {
            None => TokenStream::new(),
            Some((_, e)) => match &**e {
                Expr::Block(bl) => self.scoped_block(&bl.block.stmts),
                Expr::If(inner) => {
                    self.push();
                    let t = self.if_stmt(inner);
                    self.pop();
                    t
                }
                other => self.error(other, "expected a block or `else if`"),
            },
        };
        if self.is_comptime(&i.cond) {
            let c = &i.cond;
            return quote!(if #c { #then_t } else { #else_t });
        }
        let c = self.rt(&i.cond);
        let lc = loc(i.span());
        quote! {
            {
                let __c = #c;
                #b.open();
                { #then_t }
                let __t = #b.close();
                #b.open();
                { #else_t }
                let __e = #b.close();
                #b.if_(__c, __t, __e, #lc)?;
            }
        }
    }

    fn for_loop(&mut self, f: &syn::ExprForLoop) -> TokenStream {
        let b = b();
        if f.label.is_some() {
            return self.error(&f.label, "loop labels are not supported");
        }
        let mut unroll = false;
        for a in &f.attrs {
            if a.path().is_ident("unroll") && matches!(a.meta, syn::Meta::Path(_)) {
                unroll = true;
            } else {
                return self.error(a, "the only loop attribute is `#[unroll]`");
            }
        }
        let var = match &*f.pat {
            Pat::Ident(pi) if pi.mutability.is_none() && pi.subpat.is_none() => pi.ident.to_string(),
            Pat::Wild(_) => "_i".to_string(),
            other => return self.error(other, "`for` needs a plain loop variable"),
        };
        let (range, step) = match &*f.expr {
            Expr::Range(r) => (r, None),
            Expr::MethodCall(m) if m.method == "step_by" && m.args.len() == 1 => match strip_paren(&m.receiver) {
                Expr::Range(r) => (r, Some(&m.args[0])),
                other => return self.error(other, "write `(start..end).step_by(step)`"),
            },
            other => {
                return self.error(
                    other,
                    "`for` loops run over `start..end` or `(start..end).step_by(step)`",
                )
            }
        };
        let (Some(start), Some(end), syn::RangeLimits::HalfOpen(_)) = (&range.start, &range.end, &range.limits) else {
            return self.error(range, "`for` ranges must be half-open with both ends: `start..end`");
        };
        let s = self.rt(start);
        let e = self.rt(end);
        let st = match step {
            Some(x) => {
                let t = self.rt(x);
                quote!(::core::option::Option::Some(#t))
            }
            None => quote!(::core::option::Option::None),
        };
        self.push();
        self.define(var.clone(), VarKind::Runtime);
        let body = framed(self.stmts(&f.body.stmts));
        self.pop();
        let lc = loc(f.span());
        quote! {
            {
                let __s = #s;
                let __e = #e;
                let __st = #st;
                let __h = #b.begin_for(#var, __s, __e, __st, #lc)?;
                { #body }
                #b.end_for(__h, #unroll);
            }
        }
    }
}

/// A block's builder code in a stack frame of its own (a closure given the builder), so that a
/// long kernel's builder function does not hold every block's temporaries at once: unoptimized
/// builds give each its own stack slot, which overflowed a test thread's stack.
fn framed(t: TokenStream) -> TokenStream {
    let b = b();
    quote!(#b.scope(|#b: &mut ::ddtree_codegen::Builder| { #t ::core::result::Result::Ok(()) })?;)
}

fn strip_paren(e: &Expr) -> &Expr {
    match e {
        Expr::Paren(p) => strip_paren(&p.expr),
        Expr::Group(g) => strip_paren(&g.expr),
        other => other,
    }
}

fn is_statement_like(e: &Expr) -> bool {
    matches!(
        e,
        Expr::If(_) | Expr::ForLoop(_) | Expr::While(_) | Expr::Loop(_) | Expr::Block(_) | Expr::Macro(_)
    )
}

fn array_elem(t: &syn::Type) -> Option<Scalar> {
    match t {
        syn::Type::Array(a) => array_elem(&a.elem),
        other => scalar_of_type(other),
    }
}

fn lit_scalar(e: &Expr) -> Option<Scalar> {
    match e {
        Expr::Lit(l) => match &l.lit {
            Lit::Float(f) => match f.suffix() {
                "" | "f32" => Some(Scalar::F32),
                _ => None,
            },
            Lit::Int(i) => Scalar::from_rust_name(i.suffix()),
            Lit::Bool(_) => Some(Scalar::Bool),
            _ => None,
        },
        Expr::Unary(u) => lit_scalar(&u.expr),
        Expr::Path(p) => {
            let segs: Vec<String> = p.path.segments.iter().map(|s| s.ident.to_string()).collect();
            (segs.len() == 2).then(|| Scalar::from_rust_name(&segs[0])).flatten()
        }
        _ => None,
    }
}

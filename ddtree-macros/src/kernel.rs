//! `#[kernel]` and `#[device_fn]`: parse the attribute and signature, translate the body, emit.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::spanned::Spanned;
use syn::{Expr, FnArg, ItemFn, Pat, ReturnType, Type};

use crate::body::{is_u32x4, loc, scalar_of_type, scalar_tokens, Cx};
use crate::eval;
use crate::params::pascal_case;

/// Which attribute is being expanded.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Kernel,
    DeviceFn,
}

#[derive(Default)]
struct Attr {
    block: Option<Expr>,
    space: Option<Expr>,
    dyn_smem: Option<Expr>,
    min_blocks: Option<Expr>,
}

/// A runtime argument.
struct RtArg {
    ident: syn::Ident,
    ty: Type,
    /// Tokens of the `ddtree_codegen::Ty`.
    ir_ty: TokenStream,
    /// Host-side launcher parameter type.
    host_ty: TokenStream,
    /// How the launcher pushes it.
    push: TokenStream,
}

fn parse_attr(args: TokenStream, kind: Kind, errors: &mut Vec<syn::Error>) -> Attr {
    let mut attr = Attr::default();
    if args.is_empty() {
        return attr;
    }
    if kind == Kind::DeviceFn {
        errors.push(syn::Error::new_spanned(&args, "`#[device_fn]` takes no arguments"));
        return attr;
    }
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("block") {
            attr.block = Some(meta.value()?.parse()?);
            Ok(())
        } else if meta.path.is_ident("space") {
            attr.space = Some(meta.value()?.parse()?);
            Ok(())
        } else if meta.path.is_ident("dyn_smem") {
            attr.dyn_smem = Some(meta.value()?.parse()?);
            Ok(())
        } else if meta.path.is_ident("min_blocks") {
            attr.min_blocks = Some(meta.value()?.parse()?);
            Ok(())
        } else {
            Err(meta.error(
                "unknown `#[kernel]` argument; expected `block = ..`, `space = ..`, `dyn_smem = ..` or `min_blocks = ..`",
            ))
        }
    });
    if let Err(e) = syn::parse::Parser::parse2(parser, args) {
        errors.push(e);
    }
    attr
}

fn runtime_arg(ident: &syn::Ident, ty: &Type, errors: &mut Vec<syn::Error>) -> Option<RtArg> {
    let slice = |elem: &Type, mutable: bool| -> Option<(TokenStream, TokenStream, TokenStream)> {
        let s = scalar_of_type(elem)?;
        let st = scalar_tokens(s);
        let ir = quote!(::ddtree_codegen::Ty::Slice { elem: #st, mutable: #mutable });
        // Any cudarc buffer (a `CudaSlice` or a view into one) is accepted; the launcher binds
        // its device pointer (and the guard that orders it on the stream) before the launch.
        let ptr = format_ident!("__ptr_{}", ident);
        if mutable {
            Some((
                ir,
                quote!(&mut impl ::ddtree_runtime::cudarc::driver::DevicePtrMut<#elem>),
                quote!(&#ptr.0),
            ))
        } else {
            Some((
                ir,
                quote!(&impl ::ddtree_runtime::cudarc::driver::DevicePtr<#elem>),
                quote!(&#ptr.0),
            ))
        }
    };
    let found = match ty {
        Type::Reference(r) => match &*r.elem {
            Type::Slice(s) => slice(&s.elem, r.mutability.is_some()),
            _ => None,
        },
        other => scalar_of_type(other).map(|s| {
            let st = scalar_tokens(s);
            (
                quote!(::ddtree_codegen::Ty::Scalar(#st)),
                quote!(#other),
                quote!(&#ident),
            )
        }),
    };
    match found {
        Some((ir_ty, host_ty, push)) => Some(RtArg {
            ident: ident.clone(),
            ty: ty.clone(),
            ir_ty,
            host_ty,
            push,
        }),
        None => {
            errors.push(syn::Error::new_spanned(
                ty,
                "kernel arguments are DSL scalars (f32, bf16, f16, u32, i32, u64, bool) or slices `&[T]` / `&mut [T]` of them",
            ));
            None
        }
    }
}

/// Expands `#[kernel]` or `#[device_fn]`.
pub fn expand(args: TokenStream, item: TokenStream, kind: Kind) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(f) => f,
        Err(_) => {
            let what = if kind == Kind::Kernel {
                "#[kernel]"
            } else {
                "#[device_fn]"
            };
            let e = syn::Error::new(Span::call_site(), format!("{what} applies to functions only")).to_compile_error();
            return quote!(#e #item);
        }
    };
    let mut errors = Vec::new();
    let attr = parse_attr(args, kind, &mut errors);
    let sig = &func.sig;
    if let Some(t) = sig
        .constness
        .as_ref()
        .map(|c| c.span())
        .or(sig.asyncness.as_ref().map(|a| a.span()))
        .or(sig.unsafety.as_ref().map(|u| u.span()))
    {
        errors.push(syn::Error::new(t, "kernels cannot be const, async or unsafe"));
    }
    if !sig.generics.params.is_empty() {
        errors.push(syn::Error::new_spanned(
            &sig.generics,
            "kernels take compile-time values through a `#[comptime]` params argument, not generics",
        ));
    }

    let mut params: Option<(syn::Ident, Type)> = None;
    let mut rt_args = Vec::new();
    for input in &sig.inputs {
        let FnArg::Typed(pt) = input else {
            errors.push(syn::Error::new_spanned(input, "kernels cannot take `self`"));
            continue;
        };
        let Pat::Ident(pi) = &*pt.pat else {
            errors.push(syn::Error::new_spanned(&pt.pat, "arguments must be plain names"));
            continue;
        };
        let is_comptime = pt.attrs.iter().any(|a| a.path().is_ident("comptime"));
        for a in &pt.attrs {
            if !a.path().is_ident("comptime") {
                errors.push(syn::Error::new_spanned(
                    a,
                    "the only argument attribute is `#[comptime]`",
                ));
            }
        }
        if is_comptime {
            if kind == Kind::DeviceFn {
                errors.push(syn::Error::new_spanned(
                    pt,
                    "device functions take no `#[comptime]` params; pass values as arguments",
                ));
                continue;
            }
            if params.is_some() {
                errors.push(syn::Error::new_spanned(
                    pt,
                    "a kernel has one `#[comptime]` params argument; put every parameter in that struct",
                ));
                continue;
            }
            let ty = match &*pt.ty {
                Type::Reference(r) if r.mutability.is_none() => (*r.elem).clone(),
                Type::Path(_) => (*pt.ty).clone(),
                other => {
                    errors.push(syn::Error::new_spanned(
                        other,
                        "the params argument must be a struct type or a shared reference to one",
                    ));
                    continue;
                }
            };
            params = Some((pi.ident.clone(), ty));
        } else if let Some(a) = runtime_arg(&pi.ident, &pt.ty, &mut errors) {
            rt_args.push(a);
        }
    }

    let ret = match (&sig.output, kind) {
        (ReturnType::Default, _) => quote!(::ddtree_codegen::Ty::Void),
        (ReturnType::Type(_, t), Kind::DeviceFn) => match scalar_of_type(t) {
            Some(s) => {
                let st = scalar_tokens(s);
                quote!(::ddtree_codegen::Ty::Scalar(#st))
            }
            None if is_u32x4(t) => quote!(::ddtree_codegen::Ty::U32x4),
            None => {
                errors.push(syn::Error::new_spanned(
                    t,
                    "device functions return a DSL scalar or u32x4",
                ));
                quote!(::ddtree_codegen::Ty::Void)
            }
        },
        (ReturnType::Type(_, t), Kind::Kernel) => {
            errors.push(syn::Error::new_spanned(
                t,
                "kernels return nothing; write results to a `&mut [T]` argument",
            ));
            quote!(::ddtree_codegen::Ty::Void)
        }
    };

    let comptime_names: Vec<String> = params.iter().map(|(i, _)| i.to_string()).collect();
    let runtime_names: Vec<String> = rt_args.iter().map(|a| a.ident.to_string()).collect();
    let mut cx = Cx::new(&comptime_names, &runtime_names, kind == Kind::DeviceFn);
    let body = cx.stmts(&func.block.stmts);
    errors.append(&mut cx.errors);

    let name = sig.ident.to_string();
    let fn_loc = loc(sig.ident.span());
    let arg_decls = rt_args.iter().map(|a| {
        let n = a.ident.to_string();
        let t = &a.ir_ty;
        let l = loc(a.ty.span());
        quote!(__b.arg(#n, #t, #l)?;)
    });
    let arg_decls: Vec<TokenStream> = arg_decls.collect();
    let vis = &func.vis;

    if kind == Kind::DeviceFn {
        let mod_name = &sig.ident;
        if !errors.is_empty() {
            return fallback(
                errors,
                &func,
                quote! {
                    #[doc(hidden)]
                    #[allow(non_snake_case, dead_code)]
                    #vis mod #mod_name {
                        pub fn __ddtree_device_fn() -> ::ddtree_codegen::Result<::ddtree_codegen::ir::DeviceFn> { ::core::unreachable!() }
                    }
                },
            );
        }
        let docs = func.attrs.iter().filter(|a| a.path().is_ident("doc"));
        return quote! {
            #(#docs)*
            #[allow(non_snake_case)]
            #vis mod #mod_name {
                #[allow(unused_imports)]
                use super::*;
                /// Builds this device function's IR (called by kernels that use it).
                pub fn __ddtree_device_fn() -> ::ddtree_codegen::Result<::ddtree_codegen::ir::DeviceFn> {
                    let mut __b = ::ddtree_codegen::Builder::device_fn(#name, ::core::file!(), #ret);
                    #(#arg_decls)*
                    #body
                    __b.finish_device_fn()
                }
            }
        };
    }

    // Kernel.
    let type_name = format_ident!("{}", pascal_case(&name), span = sig.ident.span());
    let (params_ty, bind, space) = match &params {
        Some((ident, ty)) => {
            let space = match &attr.space {
                Some(Expr::Array(arr)) => {
                    let elems: Vec<Expr> = arr.elems.iter().cloned().collect();
                    eval::check_space(&elems, &ident.to_string(), &func.block.stmts, &mut errors);
                    if elems.is_empty() {
                        errors.push(syn::Error::new_spanned(
                            arr,
                            "the parameter space needs at least one candidate (index 0 is the default)",
                        ));
                    }
                    quote!(::std::vec![#(#elems),*])
                }
                Some(e) => quote!(::std::iter::IntoIterator::into_iter(#e).collect()),
                None => {
                    errors.push(syn::Error::new_spanned(
                        &sig.ident,
                        "a kernel with `#[comptime]` params needs `space = [..]` in `#[kernel(..)]`: the candidates to compile and tune (index 0 is the default)",
                    ));
                    quote!(::std::vec::Vec::new())
                }
            };
            (
                quote!(#ty),
                quote!(#[allow(unused_variables)] let #ident: &#ty = __params;),
                space,
            )
        }
        None => {
            if let Some(s) = &attr.space {
                errors.push(syn::Error::new_spanned(
                    s,
                    "`space` needs a `#[comptime]` params argument",
                ));
            }
            (quote!(()), quote!(), quote!(::std::vec![()]))
        }
    };
    let block = match &attr.block {
        None => {
            errors.push(syn::Error::new_spanned(
                &sig.ident,
                "`#[kernel]` needs `block = <threads per block>` (or `block = (x, y, z)`)",
            ));
            quote!()
        }
        Some(Expr::Tuple(t)) if t.elems.len() == 3 => {
            let (x, y, z) = (&t.elems[0], &t.elems[1], &t.elems[2]);
            quote!(__b.block_dim([(#x) as i128, (#y) as i128, (#z) as i128], #fn_loc)?;)
        }
        Some(Expr::Tuple(t)) => {
            errors.push(syn::Error::new_spanned(t, "`block` is a number or an (x, y, z) triple"));
            quote!()
        }
        Some(e) => {
            if !cx.is_comptime(e) {
                errors.push(syn::Error::new_spanned(e, "`block` must be a compile-time value"));
            }
            quote!(__b.block_dim([(#e) as i128, 1, 1], #fn_loc)?;)
        }
    };
    let dyn_smem = match &attr.dyn_smem {
        None => quote!(),
        Some(e) => {
            if !cx.is_comptime(e) {
                errors.push(syn::Error::new_spanned(e, "`dyn_smem` must be a compile-time value"));
            }
            quote!(__b.dyn_smem((#e) as i128, #fn_loc)?;)
        }
    };
    let min_blocks = match &attr.min_blocks {
        None => quote!(),
        Some(e) => {
            if !cx.is_comptime(e) {
                errors.push(syn::Error::new_spanned(e, "`min_blocks` must be a compile-time value"));
            }
            quote!(__b.min_blocks((#e) as i128, #fn_loc)?;)
        }
    };

    if !errors.is_empty() {
        return fallback(errors, &func, quote!(#vis struct #type_name;));
    }

    let docs: Vec<_> = func.attrs.iter().filter(|a| a.path().is_ident("doc")).collect();
    let host_params = rt_args.iter().map(|a| {
        let (i, t) = (&a.ident, &a.host_ty);
        quote!(#i: #t)
    });
    let binds = rt_args.iter().filter_map(|a| {
        let i = &a.ident;
        let ptr = format_ident!("__ptr_{}", i);
        match &a.ty {
            Type::Reference(r) if r.mutability.is_some() => {
                Some(quote!(let #ptr = ::ddtree_runtime::cudarc::driver::DevicePtrMut::device_ptr_mut(#i, stream);))
            }
            Type::Reference(_) => {
                Some(quote!(let #ptr = ::ddtree_runtime::cudarc::driver::DevicePtr::device_ptr(#i, stream);))
            }
            _ => None,
        }
    });
    let pushes = rt_args.iter().map(|a| {
        let p = &a.push;
        quote!(__l.arg(#p);)
    });
    quote! {
        #(#docs)*
        #[derive(Clone, Copy, Debug, Default)]
        #vis struct #type_name;

        impl ::ddtree_codegen::Kernel for #type_name {
            type Params = #params_ty;
            const NAME: &'static str = #name;

            fn space() -> ::std::vec::Vec<#params_ty> {
                #space
            }

            fn ir(__params: &#params_ty) -> ::ddtree_codegen::Result<::ddtree_codegen::KernelIr> {
                #bind
                let mut __b = ::ddtree_codegen::Builder::kernel(#name, ::core::file!(), __params);
                #block
                #dyn_smem
                #min_blocks
                #(#arg_decls)*
                #body
                __b.finish()
            }
        }

        impl #type_name {
            /// Launches a compiled variant of this kernel on `stream` over `grid` (the block
            /// shape comes from the variant's params). Arguments follow the kernel signature.
            ///
            /// # Safety
            /// The kernel trusts its scalar arguments: sizes and counts must describe the
            /// buffers passed, as the kernel's documentation states.
            #[allow(clippy::too_many_arguments)]
            #vis unsafe fn launch(
                kernel: &::ddtree_runtime::CompiledKernel<Self>,
                stream: &::std::sync::Arc<::ddtree_runtime::cudarc::driver::CudaStream>,
                grid: impl ::core::convert::Into<::ddtree_runtime::Grid>,
                #(#host_params),*
            ) -> ::core::result::Result<(), ::ddtree_runtime::RuntimeError> {
                #(#binds)*
                let mut __l = kernel.launcher(stream, grid.into())?;
                #(#pushes)*
                // SAFETY: the argument list matches the generated C signature in order and
                // type; the caller upholds the size contract above.
                unsafe { __l.launch() }
            }
        }
    }
}

/// On error: the errors, a stand-in item so uses elsewhere do not cascade, and the user's
/// function (body elided, `#[comptime]` stripped) so IDEs keep working.
fn fallback(errors: Vec<syn::Error>, func: &ItemFn, stand_in: TokenStream) -> TokenStream {
    let errs = errors.iter().map(syn::Error::to_compile_error);
    let mut f = func.clone();
    for input in f.sig.inputs.iter_mut() {
        if let FnArg::Typed(pt) = input {
            pt.attrs.retain(|a| !a.path().is_ident("comptime"));
        }
    }
    *f.block = syn::parse_quote!({ ::core::unimplemented!("kernel bodies run on the GPU") });
    quote! {
        #(#errs)*
        #stand_in
        #[allow(dead_code, unused_variables, clippy::all)]
        #f
    }
}

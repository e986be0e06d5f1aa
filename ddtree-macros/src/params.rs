//! `#[derive(KernelParams)]`.

use proc_macro2::TokenStream;
use quote::quote;
use syn::{Data, DeriveInput, Fields};

pub fn derive(item: TokenStream) -> TokenStream {
    let input: DeriveInput = match syn::parse2(item) {
        Ok(i) => i,
        Err(e) => return e.to_compile_error(),
    };
    let name = &input.ident;
    let (ig, tg, wc) = input.generics.split_for_impl();
    match &input.data {
        Data::Struct(s) => {
            let Fields::Named(fields) = &s.fields else {
                return syn::Error::new_spanned(&input.ident, "KernelParams needs a struct with named fields")
                    .to_compile_error();
            };
            let entries = fields.named.iter().map(|f| {
                let id = f.ident.as_ref().expect("named field");
                let s = id.to_string();
                quote!((#s, ::ddtree_codegen::ParamField::param_value(&self.#id)))
            });
            quote! {
                impl #ig ::ddtree_codegen::KernelParams for #name #tg #wc {
                    fn fields(&self) -> ::std::vec::Vec<(&'static str, ::ddtree_codegen::ParamValue)> {
                        ::std::vec![#(#entries),*]
                    }
                }
            }
        }
        Data::Enum(e) => {
            let mut errors = TokenStream::new();
            let arms = e.variants.iter().map(|v| {
                if !matches!(v.fields, Fields::Unit) {
                    errors
                        .extend(syn::Error::new_spanned(v, "KernelParams enums must be fieldless").to_compile_error());
                }
                let id = &v.ident;
                let snake = snake_case(&id.to_string());
                quote!(Self::#id => ::ddtree_codegen::ParamValue::Variant(#snake))
            });
            let arms: Vec<_> = arms.collect();
            if !errors.is_empty() {
                return errors;
            }
            quote! {
                impl #ig ::ddtree_codegen::ParamField for #name #tg #wc {
                    fn param_value(&self) -> ::ddtree_codegen::ParamValue {
                        match self { #(#arms),* }
                    }
                }
            }
        }
        Data::Union(_) => {
            syn::Error::new_spanned(&input.ident, "KernelParams cannot be derived for unions").to_compile_error()
        }
    }
}

/// `InterleavedLop3` -> `interleaved_lop3`.
pub fn snake_case(s: &str) -> String {
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// `rms_norm` -> `RmsNorm`.
pub fn pascal_case(s: &str) -> String {
    s.split('_')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let mut c = p.chars();
            match c.next() {
                Some(f) => f.to_uppercase().chain(c).collect::<String>(),
                None => String::new(),
            }
        })
        .collect()
}

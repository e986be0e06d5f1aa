//! Unit tests of the CLI: argument parsing and the commands on the built-in model.
use super::*;
use std::path::Path;

#[test]
fn cli_parses_prompt_ids_and_rejects_two_prompts() {
    let cli = Cli::try_parse_from(["ddtree", "generate", "--prompt-ids", "1,2,3", "--json"]).unwrap();
    let Command::Generate(args) = cli.command else {
        panic!("generate")
    };
    assert_eq!(args.prompt_ids, Some(vec![1, 2, 3]));
    assert!(args.json && args.dev.device == Device::Auto && args.model.is_none());
    assert!(Cli::try_parse_from(["ddtree", "generate", "--prompt", "a", "--prompt-ids", "1"]).is_err());
    assert!(Cli::try_parse_from(["ddtree", "generate", "--device", "tpu"]).is_err());
}

#[test]
fn cli_parses_cpu_activations() {
    let Command::Generate(args) = Cli::try_parse_from(["ddtree", "generate"]).unwrap().command else {
        panic!("generate")
    };
    assert_eq!(args.dev.cpu_activations, ActivationPrecision::F32);
    let cli = Cli::try_parse_from(["ddtree", "bench", "--device", "cpu", "--cpu-activations", "bf16"]).unwrap();
    let Command::Bench(args) = cli.command else {
        panic!("bench")
    };
    assert_eq!(args.dev.cpu_activations, ActivationPrecision::Bf16);
    assert!(Cli::try_parse_from(["ddtree", "generate", "--cpu-activations", "f16"]).is_err());
}

#[test]
fn cli_parses_drafters_and_budgets() {
    let parse = |extra: &[&str]| {
        let Command::Generate(args) = Cli::try_parse_from([&["ddtree", "generate"], extra].concat())?.command else {
            panic!("generate")
        };
        Ok::<_, clap::Error>(args)
    };
    let args = parse(&[]).unwrap();
    assert_eq!((args.drafter, args.budget, args.no_spec), (None, Budget::Auto, false));
    let args = parse(&["--drafter", "noisy:0.25", "--budget", "16", "--block-size", "16"]).unwrap();
    assert_eq!(args.drafter, Some(DrafterArg::Noisy(0.25)));
    assert_eq!((args.budget, args.block_size), (Budget::Fixed(16), Some(16)));
    assert_eq!(
        parse(&["--drafter", "oracle"]).unwrap().drafter,
        Some(DrafterArg::Oracle)
    );
    assert_eq!(
        parse(&["--drafter", "d/x"]).unwrap().drafter,
        Some(DrafterArg::Dir("d/x".into()))
    );
    assert!(parse(&["--drafter", "noisy:2"]).is_err());
    assert!(parse(&["--budget", "0"]).is_err());
    assert!(parse(&["--budget", "many"]).is_err());
}

#[test]
fn speculative_generation_matches_plain_and_reports_stats() {
    let kimi = concat!(env!("CARGO_MANIFEST_DIR"), "/../ddtree-engine/tests/fixtures/tiny-kimi");
    let run = |extra: &[&str]| {
        let Command::Generate(args) = Cli::try_parse_from(
            [
                &["ddtree", "generate", "--prompt-ids", "5,17", "--max-tokens", "9"],
                extra,
            ]
            .concat(),
        )
        .unwrap()
        .command
        else {
            panic!("generate")
        };
        let r = run(CpuBackend::default(), &args, None, None).unwrap();
        let spec = (args.drafter.is_some() || args.model.is_none()) && !args.no_spec;
        assert_eq!(r.stats.is_some(), spec);
        if let Some(stats) = &r.stats {
            let report = spec_json(stats);
            assert!(report["rounds"].as_u64().unwrap() >= 1 && report["phase_ms"]["verify"].is_number());
            let mode = if args.budget == Budget::Auto { "auto" } else { "fixed" };
            assert!(report["budget_mode"].as_str().unwrap().starts_with(mode));
        }
        r.out.tokens
    };
    let plain = run(&["--model", kimi]);
    let dflash = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../ddtree-engine/tests/fixtures/tiny-dflash"
    );
    assert_eq!(run(&["--model", kimi, "--drafter", "oracle"]), plain);
    assert_eq!(
        run(&["--model", kimi, "--drafter", "noisy:0.5", "--budget", "3"]),
        plain
    );
    assert_eq!(run(&["--model", kimi, "--drafter", dflash, "--block-size", "4"]), plain);
    assert_eq!(run(&["--model", kimi, "--drafter", "oracle", "--no-spec"]), plain);
    // The built-in pair: DDTree with the trained drafter by default, lossless.
    let builtin_plain = run(&["--no-spec"]);
    assert_eq!(run(&[]), builtin_plain);
    assert_eq!(run(&["--budget", "16"]), builtin_plain);
}

#[test]
fn cli_parses_serve() {
    let cli = Cli::try_parse_from(["ddtree", "serve"]).unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("serve")
    };
    assert_eq!((args.host.as_str(), args.port, args.max_queue), ("127.0.0.1", 8000, 64));
    assert_eq!((args.budget, args.api_key, args.drafter), (Budget::Auto, None, None));
    let cli = Cli::try_parse_from([
        "ddtree",
        "serve",
        "--port",
        "0",
        "--drafter",
        "none",
        "--budget",
        "16",
        "--api-key",
        "k",
        "--device",
        "cpu",
    ])
    .unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("serve")
    };
    assert_eq!(
        (args.port, args.budget, args.drafter.as_deref()),
        (0, Budget::Fixed(16), Some("none"))
    );
    assert!(args.dev.device == Device::Cpu && args.api_key.as_deref() == Some("k"));
    assert!(Cli::try_parse_from(["ddtree", "serve", "--port", "70000"]).is_err());
    assert!(Cli::try_parse_from(["ddtree", "serve", "--budget", "0"]).is_err());
}

#[test]
fn cli_parses_serve_on_ranks_and_gpus_and_refuses_contradictions() {
    let serve = |extra: &[&str]| {
        let Command::Serve(args) = Cli::try_parse_from([&["ddtree", "serve"], extra].concat())?.command else {
            panic!("serve")
        };
        Ok::<_, clap::Error>(args)
    };
    let args = serve(&[]).unwrap();
    assert_eq!((args.par.ranks, args.par.gpus), (None, None));
    assert_eq!(args.par.tree_source, ddtree_engine::spec::TreeSource::Replicated);
    let args = serve(&["--device", "cpu", "--ranks", "2", "--tp", "1", "--tree-source", "rank0"]).unwrap();
    assert_eq!((args.par.ranks, args.par.tp, args.par.ep), (Some(2), Some(1), None));
    assert_eq!(args.par.tree_source, ddtree_engine::spec::TreeSource::Rank0);
    assert_eq!(args.par.cpu_spec().unwrap().world, 2);
    let args = serve(&["--gpus", "4", "--ep", "1"]).unwrap();
    assert_eq!((args.par.gpus, args.par.ep), (Some(parallel::GpuCount::N(4)), Some(1)));
    assert_eq!(
        serve(&["--gpus", "auto"]).unwrap().par.gpus,
        Some(parallel::GpuCount::Auto)
    );
    // Contradictions name the flag.
    let e = serve(&["--ranks", "2", "--gpus", "2"]).err().unwrap().to_string();
    assert!(e.contains("--ranks") && e.contains("--gpus"), "{e}");
    let e = serve(&["--tree-source", "everywhere"]).err().unwrap().to_string();
    assert!(e.contains("--tree-source") && e.contains("rank0"), "{e}");
    assert!(serve(&["--gpus", "0"]).is_err());
    let e = serve(&["--ranks", "2", "--tp", "4"])
        .unwrap()
        .par
        .cpu_spec()
        .unwrap_err()
        .to_string();
    assert!(e.contains("--tp"), "{e}");
    let e = serve(&["--ranks", "3"])
        .unwrap()
        .par
        .cpu_spec()
        .unwrap_err()
        .to_string();
    assert!(e.contains("--gpus/--ranks"), "{e}");
    // Generate and bench take the tree source too.
    let Command::Generate(g) = Cli::try_parse_from(["ddtree", "generate", "--ranks", "2", "--tree-source", "rank0"])
        .unwrap()
        .command
    else {
        panic!("generate")
    };
    assert_eq!(g.par.tree_source, ddtree_engine::spec::TreeSource::Rank0);
}

#[test]
fn eval_rejects_a_model_without_drafter_and_prompts() {
    assert!(Cli::try_parse_from(["ddtree", "eval", "--model", "x"]).is_err());
    let cli = Cli::try_parse_from(["ddtree", "eval", "--budgets", "2,4", "--limit", "1", "--json"]).unwrap();
    let Command::Eval(args) = cli.command else {
        panic!("eval")
    };
    assert_eq!((args.budgets, args.limit, args.max_tokens), (vec![2, 4], Some(1), 64));
}

#[test]
fn cuda_device_without_a_gpu_is_a_clear_error() {
    if ddtree_runtime::driver_available() {
        eprintln!("SKIP: a CUDA driver is present; this test checks the no-GPU message");
        return;
    }
    let dev = |device| DeviceArgs {
        device,
        no_autotune: false,
        no_cuda_graphs: false,
        one_stream: false,
        no_pdl: false,
        attention: AttentionKernel::Auto,
        cpu_activations: ActivationPrecision::Bf16,
    };
    let err = on_device(&dev(Device::Cuda), tiny::kimi::config, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no CUDA driver"), "{err}");
    // `auto` falls back to the CPU, at the asked activation precision.
    let mut picked = "";
    on_device(&dev(Device::Auto), tiny::kimi::config, |b| {
        picked = match b {
            AnyBackend::Cpu(cpu) if cpu.activations() == ActivationPrecision::Bf16 => "cpu bf16",
            AnyBackend::Cpu(_) => "cpu f32",
            AnyBackend::Cuda(_) => "cuda",
        };
        Ok(())
    })
    .unwrap();
    assert_eq!(picked, "cpu bf16");
}

#[test]
fn bench_runs_the_tiny_preset_on_the_cpu() {
    let cli = Cli::try_parse_from(["ddtree", "bench", "--preset", "tiny", "--device", "cpu"]).unwrap();
    let Command::Bench(args) = cli.command else {
        panic!("bench")
    };
    bench_on(CpuBackend::default(), &args, None).unwrap();
    let cli = Cli::try_parse_from(["ddtree", "bench", "--preset", "kimi"]).unwrap();
    let Command::Bench(args) = cli.command else {
        panic!("bench")
    };
    let err = bench_on(CpuBackend::default(), &args, None).unwrap_err().to_string();
    assert!(err.contains("unknown bench preset"), "{err}");
}

#[test]
fn text_prompt_without_tokenizer_names_the_model() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ddtree-engine/tests/fixtures/tiny-dsv3");
    let cli = Cli::try_parse_from(["ddtree", "generate", "--prompt", "hi", "--model", dir.to_str().unwrap()]).unwrap();
    let Command::Generate(args) = cli.command else {
        panic!("generate")
    };
    let err = generate(AnyBackend::Cpu(CpuBackend::default()), &args)
        .unwrap_err()
        .to_string();
    assert!(err.contains("tiny-dsv3") && err.contains("--prompt-ids"), "{err}");
}

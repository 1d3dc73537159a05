//! The `mkc` command line: parses flags, calls the library, renders reports.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use mkc::config::Config;
use mkc::contract::MAX_RANKS;
use mkc::lower::Limits;
use mkc::sizes::{graph_sizes, Resident, MAX_EXPERT_PARALLEL};
use mkc::target::Target;
use mkc::{checkpoint, diag, dot, emit, plan, report, Error, ErrorKind};

/// The largest `--batch`: sequences one step carries. Above the device's
/// `kMaxBatch` (8) the projections take the wider register budget, and the
/// planner refuses, by name, each operation whose scratch a batch outgrows.
const MAX_BATCH: i64 = 64;

/// The most positions per sequence in a speculative verify step (the device's
/// `kMaxPositions`).
const MAX_SPECULATIVE: i64 = mkc::contract::MAX_POSITIONS as i64;

/// `--acceptance`: a probability.
fn acceptance(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(a) if (0.0..=1.0).contains(&a) => Ok(a),
        _ => Err(format!("`{s}` is not a probability between 0 and 1")),
    }
}

/// The largest `--context`: 16M tokens, so every per-sequence size (tokens
/// times bytes per token) stays far from 64-bit overflow.
const MAX_CONTEXT: u64 = mkc::ir::MAX_CONTEXT;

#[derive(Parser)]
#[command(
    name = "mkc",
    version,
    about = "Compile an LLM decode-step graph to a CUDA megakernel",
    after_help = "Sizes are in decimal units (1 GB = 10^9 bytes); docs/SIZES.md defines each term."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a graph, print its sizes and whether it fits each target; optionally check a checkpoint.
    ///
    /// Prints op counts, parameters, weights resident and read per step, state
    /// per sequence, and whether weights and state fit one GPU of each built-in
    /// target (or of --target), with the smallest expert-parallel degree that
    /// does. With --checkpoint, every tensor of a Hugging Face checkpoint is
    /// checked against the graph by name, shape and type.
    Check {
        /// The graph file (`model_graphs/<model>/graph.mkc`).
        graph: PathBuf,
        /// The model config (`config.json` or YAML); default: the checkpoint's
        /// config.json, else config.json beside the graph.
        #[arg(long)]
        config: Option<PathBuf>,
        /// A Hugging Face checkpoint directory to check tensor by tensor.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Context length the per-sequence state is sized for.
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=MAX_CONTEXT))]
        context: u64,
        /// The target whose HBM the capacity is checked against (default: every
        /// built-in target): a name (`mkc targets`) or a YAML file.
        #[arg(long)]
        target: Option<String>,
        /// Sequences whose state is resident, for the capacity check.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH))]
        batch: u32,
        /// GPUs the routed experts are sharded over, for the capacity check.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_EXPERT_PARALLEL as i64))]
        expert_parallel: u32,
    },
    /// Plan the decode step for a target and print its structure; --estimate adds step time.
    ///
    /// Fuses, tiles, specializes, schedules and verifies the step. The first
    /// line says whether one GPU holds weights, state, activations and tables
    /// (and if not, the smallest --expert-parallel that does); --estimate adds
    /// what one GPU holds, bytes moved per step, predicted step time and
    /// tokens/s at batch 1 and 8; --yaml, --dot and --html write the plan.
    Plan {
        /// The graph file.
        graph: PathBuf,
        /// The target: a built-in name (`mkc targets`: b200, gb300, h200) or a
        /// YAML file (a path: contains `/` or ends in .yaml or .yml).
        #[arg(long)]
        target: String,
        /// The model config (default: config.json beside the graph).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print what one GPU holds, bytes moved per step, predicted step time
        /// and tokens/s at batch 1 and 8.
        #[arg(long)]
        estimate: bool,
        /// Batch the plan dumps (--yaml, --dot) are made for.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH))]
        batch: u32,
        /// Context length the attention work is sized for.
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=MAX_CONTEXT))]
        context: u64,
        /// GPUs the routed experts are sharded over: plan one GPU's share
        /// (its experts, every other weight) and, after each MoE layer, the
        /// exchange that adds the GPUs' parts.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_EXPERT_PARALLEL as i64))]
        expert_parallel: u32,
        /// Write the plan as YAML.
        #[arg(long)]
        yaml: Option<PathBuf>,
        /// Write the fused graph for Graphviz.
        #[arg(long)]
        dot: Option<PathBuf>,
        /// Write a self-contained HTML page: the fused graph and the per-SM timeline.
        #[arg(long)]
        html: Option<PathBuf>,
        /// A measured step (Chrome trace JSON, as the runtime's profiled step
        /// writes it) of the plan at --batch: overlaid on the --html page's
        /// schedule; with --estimate, each stage's predicted span against
        /// its measured one.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// With --estimate: speculative decoding, POSITIONS per sequence in a
        /// verify step (the last token and POSITIONS - 1 drafts); prints
        /// tokens/s per user with speculation beside plain decoding.
        #[arg(long, value_name = "POSITIONS", requires = "estimate",
              value_parser = clap::value_parser!(u32).range(1..=MAX_SPECULATIVE))]
        speculative: Option<u32>,
        /// With --estimate: GPUs of one NVLink domain, the routed experts
        /// sharded over them and everything else replicated; prints one GPU's
        /// step with the all-reduce of each MoE layer (sets --expert-parallel).
        #[arg(long, requires = "estimate", conflicts_with = "expert_parallel",
              value_parser = clap::value_parser!(u32).range(1..=MAX_EXPERT_PARALLEL as i64))]
        gpus: Option<u32>,
        /// With --speculative: the chance that a draft is accepted (0 to 1).
        #[arg(long, default_value_t = 0.7, requires = "speculative", value_parser = acceptance)]
        acceptance: f64,
    },
    /// Write program.cuh, model.cu, CMakeLists.txt and plan.mkcplan into a folder.
    ///
    /// Plans the step, then writes program.cuh (one device function per kind
    /// of stage), model.cu (the runtime: checkpoint upload, KV cache, step,
    /// C ABI), its CMakeLists.txt, plan.mkcplan (schedule, stage parameters,
    /// weight table) and plan_summary.txt (the plan file's sections and
    /// sha256). Refuses a model one GPU cannot hold (--ignore-capacity).
    Codegen {
        /// The graph file.
        graph: PathBuf,
        /// The model config (default: config.json beside the graph).
        #[arg(long)]
        config: Option<PathBuf>,
        /// The target: a built-in name (`mkc targets`) or a YAML file.
        #[arg(long)]
        target: String,
        /// Batch the plan is made for.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_BATCH))]
        batch: u32,
        /// A speculative verify step: POSITIONS consecutive positions of each
        /// of the --batch sequences (its last accepted token and POSITIONS - 1
        /// drafts), batch x POSITIONS rows a step (mkc_model_verify). Models
        /// whose only per-sequence state is MLA's cache (the K2 family).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_SPECULATIVE))]
        positions: u32,
        /// Context length the attention work is sized for.
        #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..=MAX_CONTEXT))]
        context: u64,
        /// GPUs the routed experts are sharded over: the program of one GPU
        /// of them (each runs it with its share of every MoE layer's experts
        /// and exchanges its part of the layer's output with the others).
        /// The runtime launches one GPU so far: such a program compiles, and
        /// loading it says so.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=MAX_RANKS as i64))]
        expert_parallel: u32,
        /// The output folder (created if missing).
        #[arg(short, long)]
        out: PathBuf,
        /// Emit only the plan file, without stage kinds (for graphs with
        /// operations the device library does not compute yet).
        #[arg(long)]
        tables_only: bool,
        /// Say nothing when one GPU cannot hold the model (weights, state,
        /// activations and tables over the target's HBM); the program is
        /// written either way, with a warning by default.
        #[arg(long)]
        ignore_capacity: bool,
    },
    /// Print the op graph, one node a line (name, types, operands), or as Graphviz dot.
    Graph {
        /// The graph file.
        graph: PathBuf,
        /// The model config (default: config.json beside the graph).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Print Graphviz dot.
        #[arg(long)]
        dot: bool,
    },
    /// List the built-in targets with their key numbers (SMs, HBM, bandwidth).
    Targets,
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    ///
    /// For example `mkc completions bash > ~/.local/share/bash-completion/completions/mkc`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// The exit status of a program that writes into a closed pipe: 128 plus
/// SIGPIPE, as the shell reports it for coreutils (`seq 1 1000000 | head`).
const BROKEN_PIPE: u8 = 141;

/// Why the program stopped early.
enum Stop {
    /// A rendered error for stderr.
    Error(String),
    /// Standard output could not be written.
    Output(std::io::Error),
}

impl From<String> for Stop {
    fn from(msg: String) -> Self {
        Stop::Error(msg)
    }
}

impl From<std::io::Error> for Stop {
    fn from(e: std::io::Error) -> Self {
        Stop::Output(e)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let result = run(cli, &mut out).and_then(|code| out.flush().map(|()| code).map_err(Stop::Output));
    match result {
        Ok(code) => code,
        Err(Stop::Error(msg)) => {
            // What was printed before the error still goes out; a failure to
            // write it is not worth a second message.
            let _ = out.flush();
            eprint!("{msg}");
            ExitCode::FAILURE
        }
        // A reader that stopped early (`mkc graph ... | head`) is not an error:
        // end quietly, with the status a process killed by SIGPIPE has.
        Err(Stop::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::from(BROKEN_PIPE),
        Err(Stop::Output(e)) => {
            eprintln!("error: cannot write to standard output: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Renders an error that has no place in a graph file (targets, output files).
fn plain(e: &Error) -> String {
    diag::render(e, "", "")
}

/// Reads and validates the graph; returns it with the graph file's text (for
/// rendering later errors).
fn load(
    graph: &Path,
    config: Option<&Path>,
    checkpoint: Option<&Path>,
) -> Result<(mkc::valid::Validated, String), String> {
    let source = mkc::files::read_input(graph, mkc::files::Input::Graph).map_err(|e| plain(&e))?;
    let config_path = match (config, checkpoint) {
        (Some(c), _) => c.to_path_buf(),
        (None, Some(dir)) => dir.join("config.json"),
        (None, None) => mkc::default_config_path(graph),
    };
    let render = |e: &Error| diag::render(e, &graph.display().to_string(), &source);
    let config = Config::load(&config_path).map_err(|e| render(&e))?;
    let v = mkc::compile_str(&source, &config, Limits::default()).map_err(|e| render(&e))?;
    Ok((v, source))
}

fn run(cli: Cli, out: &mut impl Write) -> Result<ExitCode, Stop> {
    match cli.command {
        Command::Check { graph, config, checkpoint: ckpt, context, target, batch, expert_parallel } => {
            let (v, _) = load(&graph, config.as_deref(), ckpt.as_deref())?;
            write!(out, "{}", report::summarize(&v, context, &[1, 8]).render())?;
            let targets = match target {
                Some(t) => vec![Target::load(&t).map_err(|e| plain(&e))?],
                None => Target::builtin().map_err(|e| plain(&e))?,
            };
            let resident = Resident::of_graph(graph_sizes(&v, batch.into(), context, expert_parallel.into()));
            writeln!(out, "resident on one GPU (weights and state; plan adds activations and tables):")?;
            write!(out, "{}", resident.render())?;
            for t in &targets {
                writeln!(out, "{}", resident.verdict(&v, &t.name, t.hbm_bytes))?;
            }
            if let Some(dir) = ckpt {
                let r = checkpoint::check(&dir, &v).map_err(|e| plain(&e))?;
                writeln!(
                    out,
                    "checkpoint {}: {} file(s), {} tensors, {} needed, {} unused",
                    dir.display(),
                    r.files.len(),
                    r.tensors,
                    r.required,
                    r.unused
                )?;
                if !r.problems.is_empty() {
                    for p in &r.problems {
                        writeln!(out, "  {p}")?;
                    }
                    writeln!(out, "checkpoint does not match the graph: {} problem(s)", r.problems.len())?;
                    return Ok(ExitCode::FAILURE);
                }
                writeln!(out, "checkpoint matches the graph")?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Plan {
            graph,
            target,
            config,
            estimate,
            batch,
            context,
            expert_parallel,
            yaml,
            dot,
            html,
            trace,
            speculative,
            acceptance,
            gpus,
        } => {
            let expert_parallel = gpus.unwrap_or(expert_parallel);
            if trace.is_some() && html.is_none() && !estimate {
                return Err("error: --trace is read with --html (the measured step on the page) or --estimate (each \
                            stage's predicted span against its measured one)\n"
                    .to_string()
                    .into());
            }
            let (v, source) = load(&graph, config.as_deref(), None)?;
            let target = Target::load(&target).map_err(|e| plain(&e))?;
            let render = |e: &Error| diag::render(e, &graph.display().to_string(), &source);
            let opts = plan::Options { batch, context, expert_parallel, ..Default::default() };
            let main = plan::plan(&v, &target, opts).map_err(|e| render(&e))?;
            let measured = match &trace {
                Some(t) => {
                    let text = mkc::files::read_input(t, mkc::files::Input::Trace).map_err(|e| plain(&e))?;
                    Some(
                        plan::html::trace::parse(&text, &main)
                            .map_err(|e| format!("error: trace {}: {e}\n", t.display()))?,
                    )
                }
                None => None,
            };
            let sizes = graph_sizes(&v, batch.into(), context, expert_parallel.into());
            let resident = Resident::of_plan(sizes, &main, target.sms);
            writeln!(out, "{}", resident.verdict(&v, &target.name, target.hbm_bytes))?;
            write!(out, "{}", plan::estimate::render_structure(&main))?;
            if estimate {
                writeln!(out, "resident on one GPU at batch {batch}: {}", report::bytes(resident.total()))?;
                write!(out, "{}", resident.render())?;
                if expert_parallel > 1 {
                    writeln!(
                        out,
                        "assumptions: one GPU of {expert_parallel}: each MoE layer's routed experts sharded over them \
                         (this GPU holds 1/{expert_parallel}, with that share of the distinct experts a step selects \
                         under uniform routing); every other weight and all state replicated on each GPU; after each \
                         MoE layer, its partial sums sent to every other GPU and the GPUs' parts added (an exchange's \
                         send and reduce stages, at the target's nvlink_bandwidth and nvlink_latency_ns)"
                    )?;
                }
                let spec = speculative.map(|tokens| plan::estimate::Speculation { tokens, acceptance });
                if let Some(g) = gpus {
                    writeln!(out, "{}", plan::multi::assumptions(&target, g))?;
                    for b in [1, 8] {
                        // The plan above is one GPU's of g at its batch: not planned again.
                        let m = if b == batch {
                            plan::multi::estimate_of(&main, &target, g)
                        } else {
                            plan::multi::estimate_on(&v, &target, b, context, g)
                        }
                        .map_err(|e| plain(&e))?;
                        write!(out, "{}", plan::multi::render(&m))?;
                        if let Some(s) = spec {
                            let verify = plan::multi::estimate_verify(&v, &target, b, s.tokens, context, g)
                                .map_err(|e| format!("beyond the device library: {}", e.reason));
                            write!(
                                out,
                                "{}",
                                plan::multi::render_speculative(&m, verify.as_ref().map_err(String::as_str), s)
                            )?;
                        }
                    }
                    if target.name == "gb300" && g == 72 {
                        writeln!(
                            out,
                            "for comparison: NVIDIA's hand-written K3 decode megakernel, 423 tokens/s per user on a GB300 \
                             NVL72 (its speculative decoding not stated; {})",
                            if spec.is_some() {
                                "the speculative lines above state theirs"
                            } else {
                                "this estimate has none"
                            }
                        )?;
                    }
                }
                if spec.is_some() {
                    writeln!(out, "{}", plan::estimate::SPECULATION_ASSUMPTIONS)?;
                }
                for b in [1, 8] {
                    let p = if b == batch {
                        main.clone()
                    } else {
                        plan::plan(
                            &v,
                            &target,
                            plan::Options { batch: b, context, expert_parallel, ..Default::default() },
                        )
                        .map_err(|e| render(&e))?
                    };
                    let plain = plan::estimate::estimate(&p);
                    write!(out, "{}", plan::estimate::render(&plain, target.read_bandwidth()))?;
                    if let Some(s) = spec {
                        // The verify step: b sequences of s.tokens positions each, planned as the program
                        // `codegen --batch b --positions s.tokens` makes (b x s.tokens rows).
                        let positions = b * s.tokens;
                        let verify = if positions > MAX_BATCH as u32 {
                            Err(format!("past the planner's {MAX_BATCH} tokens per step"))
                        } else {
                            plan::plan(
                                &v,
                                &target,
                                plan::Options { batch: positions, context, expert_parallel, positions: s.tokens },
                            )
                            .map(|p| plan::estimate::estimate(&p))
                            .map_err(|e| format!("beyond the device library: {}", e.reason))
                        };
                        write!(
                            out,
                            "{}",
                            plan::estimate::render_speculative(&plain, verify.as_ref().map_err(String::as_str), s)
                        )?;
                    }
                }
            }
            if let Some(path) = yaml {
                let text = serde_yaml::to_string(&main).map_err(|e| format!("error: cannot write YAML: {e}\n"))?;
                mkc::files::write_file(&path, text.as_bytes()).map_err(|e| plain(&e))?;
            }
            if estimate {
                if let Some(m) = &measured {
                    write!(out, "{}", plan::estimate::render_measured(&main, m, target.task_overhead_ns))?;
                }
            }
            if let Some(path) = html {
                mkc::files::write_file(&path, plan::html::to_html_measured(&main, measured.as_ref()).as_bytes())
                    .map_err(|e| plain(&e))?;
            }
            if let Some(path) = dot {
                mkc::files::write_file(&path, plan::dot::to_dot(&main).as_bytes()).map_err(|e| plain(&e))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Codegen {
            graph,
            config,
            target,
            batch,
            positions,
            context,
            expert_parallel,
            out: folder,
            tables_only,
            ignore_capacity,
        } => {
            let (v, source) = load(&graph, config.as_deref(), None)?;
            let t = Target::load(&target).map_err(|e| plain(&e))?;
            let render = |e: &Error| diag::render(e, &graph.display().to_string(), &source);
            if i64::from(batch) * i64::from(positions) > MAX_BATCH {
                let e = Error::new(
                    ErrorKind::Limit,
                    format!(
                        "--batch {batch} x --positions {positions} is {} rows a step, more than {MAX_BATCH}",
                        batch * positions
                    ),
                );
                return Err(plain(&e).into());
            }
            let batch = batch * positions;
            let opts = plan::Options { batch, context, positions, expert_parallel };
            let p = plan::plan(&v, &t, opts).map_err(|e| render(&e))?;
            let resident = Resident::of_plan(graph_sizes(&v, batch.into(), context, expert_parallel.into()), &p, t.sms);
            if !ignore_capacity && !resident.fits(t.hbm_bytes) {
                // The program is written (the full K3 is the product; generated/ holds it and CI compiles
                // it); that one GPU cannot hold the model is said, with the degree that would fit.
                let shard = match resident.expert_parallel_that_fits(&v, t.hbm_bytes) {
                    Some(n) if n > expert_parallel => {
                        format!("; its experts sharded over {n} GPUs would fit (--expert-parallel {n})")
                    }
                    _ => String::new(),
                };
                let share = if expert_parallel > 1 { "one GPU's share of" } else { "every expert included in" };
                eprint!(
                    "warning[mkc::limit]: the model does not fit one {}: {} resident > {} HBM (batch {batch}, \
                     context {context}, --expert-parallel {expert_parallel}){shard}\n  = note: the program is \
                     written, {share} it; it will not load on one {}. --ignore-capacity silences this warning\n",
                    t.name,
                    report::bytes(resident.total()),
                    report::bytes(t.hbm_bytes),
                    t.name
                );
            }
            let config_name = config.clone().unwrap_or_else(|| mkc::default_config_path(&graph));
            let from =
                emit::Provenance { graph: graph.display().to_string(), config: config_name.display().to_string() };
            let name = folder.file_name().map_or_else(|| v.graph().model.clone(), |n| n.to_string_lossy().into_owned());
            let artifact = emit::emit(&v, &p, &name, &from, &source, tables_only).map_err(|e| render(&e))?;
            let plan_file = (emit::PLAN_FILE.to_string(), artifact.plan.clone());
            let files: Vec<(String, Vec<u8>)> =
                artifact.files.iter().map(|(f, t)| (f.clone(), t.as_bytes().to_vec())).chain([plan_file]).collect();
            let written = mkc::files::write_folder(&folder, &files).map_err(|e| plain(&e))?;
            for path in written {
                writeln!(out, "wrote {}", path.display())?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Targets => {
            write!(out, "{}", mkc::target::table(&Target::builtin().map_err(|e| plain(&e))?))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut Cli::command(), "mkc", out);
            Ok(ExitCode::SUCCESS)
        }
        Command::Graph { graph, config, dot: as_dot } => {
            let (v, _) = load(&graph, config.as_deref(), None)?;
            if as_dot {
                write!(out, "{}", dot::to_dot(&v))?;
            } else {
                let g = v.graph();
                for id in v.order() {
                    let n = g.node(*id);
                    let operands: Vec<String> = g.operands(*id).iter().map(|o| g.node(o.node).name.clone()).collect();
                    writeln!(
                        out,
                        "{:<48} {:?} <- [{}]",
                        n.name,
                        n.outputs.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
                        operands.join(", ")
                    )?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

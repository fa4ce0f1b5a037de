//! Prints one case of `mma-check verify` (seed 0x25): its inputs, the exact products and what
//! each model variant gives. `cargo run --release -p tarfa-mma --example cex -- TILE ROW COL`
//! (the numbers of a counterexample line).
use tarfa_mma::cases;
use tarfa_mma::model::{fused_group, Params};

fn bf(x: u16) -> f64 {
    f32::from_bits((x as u32) << 16) as f64
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|s| s.parse().ok())
        .collect();
    let [tile, row, col] = args[..] else {
        eprintln!("usage: cex TILE ROW COL (ROW < 16, COL < 8)");
        std::process::exit(2);
    };
    let (row, col) = (row as usize, col as usize);
    if row >= 16 || col >= 8 {
        eprintln!("cex: ROW must be < 16 and COL < 8");
        std::process::exit(2);
    }
    let (mode, t) = cases::tile(0x25, tile);
    let (a, b, c) = (t.a[row], t.b[col], t.c[row][col]);
    println!("mode {}", mode.name());
    println!(
        "a {a:04x?}\nb {b:04x?}\nc {c:08x} ({:e})",
        f32::from_bits(c)
    );
    for i in 0..16 {
        let p = bf(a[i]) * bf(b[i]);
        println!("  p{i:2} = {p:e}  log2 {:.2}", p.abs().log2());
    }
    let nz = Params {
        zeros_in_max: false,
        zero_c_in_max: false,
        ..Params::HOPPER
    };
    for (name, p) in [
        ("hopper (MMA-Sim)", Params::HOPPER),
        ("no-zeros-in-max", nz),
        ("hopper-measured", Params::HOPPER_MEASURED),
    ] {
        println!("{name:<18} {:08x}", fused_group(&a, &b, c, &p));
    }
}

use tarfa_mma::cases;
use tarfa_mma::model::{fused_group, Params};
fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    let (tile, row, col) = (args[0], args[1] as usize, args[2] as usize);
    let (_, t) = cases::tile(0x25, tile);
    let a = t.a[row];
    let b = t.b[col];
    let c = t.c[row][col];
    println!(
        "a {:04x?}\nb {:04x?}\nc {:08x} ({:e})",
        a,
        b,
        c,
        f32::from_bits(c)
    );
    for i in 0..16 {
        let p = bf(a[i]) * bf(b[i]);
        println!("  p{i:2} = {:e}  log2 {:.2}", p, p.abs().log2());
    }
    let h = Params {
        zeros_in_max: false,
        zero_c_in_max: false,
        ..Params::HOPPER
    };
    println!("no-zeros-in-max {:08x}", fused_group(&a, &b, c, &h));
    println!(
        "hopper          {:08x}",
        fused_group(&a, &b, c, &Params::HOPPER)
    );
    for f in 24..=30 {
        println!(
            "frac{f}          {:08x}",
            fused_group(&a, &b, c, &Params { frac_bits: f, ..h })
        );
    }
}
fn bf(x: u16) -> f64 {
    f32::from_bits((x as u32) << 16) as f64
}

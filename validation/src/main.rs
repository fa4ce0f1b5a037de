fn main() {
    eprintln!("tarfa-validate: see validation/README.md");
}
